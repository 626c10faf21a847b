"""What the decoder engine is made of, and how it is built: backends chosen, model loaded, warmed up.

`build_parts(config)` runs on the engine thread at start (engine_core.py): it resolves the "auto"
backends for the configured device and dtype (`resolve_backends`, which builds the C kernels when
the cpu backends are candidates), loads the tokenizer and the weights, sizes the KV cache, the
block manager, the scheduler and the adapter slots, and runs one warm-up step through all of them
(warmup.py). Nothing here runs before start: `DecoderConfig` only checks and derives values.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.common.memory import back_with_huge_pages
from services.decoder.attention import resolve_attention_backend
from services.decoder.block_manager import BlockManager
from services.decoder.config import AUTO, DecoderConfig
from services.decoder.grammar import GrammarCompiler
from services.decoder.kv_cache import KVCache
from services.decoder.linear import resolve_linear_backend
from services.decoder.lora import AdapterSlots, LoRAContext, expert_parts, target_shapes
from services.decoder.lora.registry import make_backend, resolve_lora_backend
from services.decoder.model_qwen2_vl import VisionTokens, is_qwen2_vl, text_config
from services.decoder.model_runner import ModelRunner
from services.decoder.models import load_model, model_sliding_window
from services.decoder.multimodal import PromptBuilder
from services.decoder.quantized_model import quantization
from services.decoder.rotary import RotaryEmbedding
from services.decoder.scheduler import Scheduler
from services.decoder.token_text import TokenTexts
from services.decoder.tokens import check_chat_template
from services.decoder.warmup import warm_up

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backends:
    """The attention, LoRA and linear backends an engine computes with ("auto" resolved)."""

    attention: str
    lora: str
    linear: str
    pointwise: bool = False  # RMSNorm, rotary and the SiLU gate in the C kernels (kernels/pointwise.py)


def resolve_backends(config: DecoderConfig) -> Backends:
    """`config`'s backends, each "auto" resolved to the fastest that runs on its device and dtype
    (the registries' `resolve_*_backend`: they build the C kernels when the cpu backends are
    candidates, and log each automatic choice with its reason). The C RMSNorm, rotary and SiLU gate
    come with the cpu linear backend, and with an automatic choice of torch's GEMM on a CPU where
    the kernels build (torch's bfloat16 GEMM where it has AVX512-BF16 or AMX: its elementwise ops
    still ran ~8% of a bf16 prefill step there, as separate passes over each activation)."""
    device, dtype = config.torch_device, config.dtype
    linear = resolve_linear_backend(config.linear_backend, device, dtype, config.quantized)
    pointwise = linear == "cpu"
    if config.linear_backend == AUTO and linear == "torch" and device.type == "cpu":
        from services.decoder.kernels import native

        pointwise = native.unavailable(dtype) is None
    return Backends(resolve_attention_backend(config.attention_backend, device, dtype, config.block_size),
                    resolve_lora_backend(config.lora_backend, device, dtype), linear, pointwise)


@dataclass
class EngineParts:
    """The built engine: model, cache, scheduler, adapter slots and the request-side helpers."""

    backends: Backends
    tokenizer: PreTrainedTokenizerBase
    token_texts: TokenTexts
    eos_token_ids: set[int]
    model: torch.nn.Module
    cache: KVCache
    block_manager: BlockManager
    scheduler: Scheduler
    bank: AdapterSlots
    image_token_id: int | None
    prompts: PromptBuilder
    runner: ModelRunner
    grammars: GrammarCompiler
    quantization: str = ""  # GGML types kept quantized and the kernels' mode ("Q4_1 exact"); "" dense


def build_parts(config: DecoderConfig) -> EngineParts:
    """Build every part for `config` and run the warm-up step (`warm_up_parts`).

    Raises:
        ValueError: a configuration that cannot run (a chat template that never finishes, an
            image token outside the vocabulary, a failed warm-up step).
        whatever loading the tokenizer or the weights raises (OSError for missing files).
    """
    backends = resolve_backends(config)
    dtype, device = getattr(torch, config.dtype), config.torch_device
    model_config = dict(config.checkpoint.raw)
    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    check_chat_template(tokenizer)  # before the weights: a template that never finishes is refused
    model = load_model(config.checkpoint, dtype, config.mrope_section, config.model_impl,
                       config.quant_mode).to(device)
    model.rotary.to(device)  # a plain table, not a module buffer: model.to() leaves it
    if isinstance(model.rotary, RotaryEmbedding):
        model.rotary.use_table(config.max_model_len)
    spec = model.spec
    cache = KVCache(spec.num_layers, config.num_blocks, config.block_size, spec.num_kv_heads, spec.head_dim,
                    config.kv_cache_torch_dtype, device)
    block_manager = BlockManager(config.num_blocks, config.block_size)
    scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_waiting,
                          model_sliding_window(model))
    lora_dtype = config.lora_torch_dtype
    if lora_dtype != dtype and backends.lora == "triton":
        raise ValueError(f"the triton LoRA backend computes factors of the model's dtype, not lora_dtype "
                         f"{config.lora_dtype!r} on dtype {config.dtype!r} (--lora-backend cpu or torch)")
    lora_backend = make_backend(backends.lora)
    bank = AdapterSlots(config.adapter_slots, config.max_lora_rank, target_shapes(model), lora_dtype, device,
                        expert_parts(model), tiled_bt=lora_backend.tiled_bt)
    image_token_id = _image_token_id(config, model_config, tokenizer)
    vision = VisionTokens.from_config(model_config) if is_qwen2_vl(model_config) else None
    prompts = PromptBuilder(tokenizer, spec.vocab_size, spec.hidden_size, config.mrope_section, image_token_id,
                            vision.start if vision else None, vision.end if vision else None, compute_dtype=dtype)
    runner = ModelRunner(model, cache, block_manager, LoRAContext(bank, lora_backend),
                         config.mrope_section is not None, backends.attention, backends.linear, config.decode_step,
                         backends.pointwise)
    eos_token_ids = _eos_token_ids(config, model_config)
    grammars = GrammarCompiler(tokenizer, spec.vocab_size, [t for t in eos_token_ids if 0 <= t < spec.vocab_size],
                               config.structured_outputs_compile_timeout, config.structured_outputs_cache_size)
    parts = EngineParts(backends, tokenizer, TokenTexts(tokenizer), eos_token_ids, model,
                        cache, block_manager, scheduler, bank, image_token_id, prompts, runner, grammars,
                        f"{types} {config.quant_mode}" if (types := quantization(model)) else "")
    warm_up_parts(config, parts)
    _huge_pages(parts)
    return parts


def _huge_pages(parts: EngineParts) -> None:
    """Back the weights a decode step streams (row-major, packed panels or GGUF blocks) with huge
    pages (services/common/memory.py; the LoRA slots' factors follow when allocated, slots.py, and
    the KV cache is marked for them before it is zeroed, kv_cache.py). SmolLM2-135M bf16 on a 2-core
    AMD EPYC VM: one captured decode step replayed, 4 KiB -> 2 MiB pages, 32 rows 31.2 -> 29.1 ms,
    one row 6.38 -> 5.96 ms; two engines in one process (4 KiB vs huge pages), P1 rounds of 32
    requests (32 + 32 tokens) alternating, 8 pairs: base-only 1.04x, 8 adapters r16 1.03x the tok/s."""
    model, started = parts.model, time.monotonic()
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        gemm = getattr(module, "gemm", None)
        tensors += [t for t in vars(gemm).values() if isinstance(t, torch.Tensor)] if gemm is not None else []
    if collapsed := back_with_huge_pages(tensors):
        log.info("weights: %d MiB in huge pages (%.2f s)", collapsed >> 20, time.monotonic() - started)


def warm_up_parts(config: DecoderConfig, parts: EngineParts) -> None:
    """One real prefill and decode step through the configured backends (warmup.py), before
    `start` returns and health says SERVING.

    Raises:
        ValueError: the step failed: this configuration cannot run here. One line naming the
            device, the three backends and the cause; the traceback is logged.
    """
    try:
        warm_up(parts.scheduler, parts.runner, parts.bank,
                min(config.num_blocks * config.block_size, config.max_model_len), config.torch_device)
    except Exception as error:  # whatever a backend raises means it cannot serve
        log.error("the decoder's warm-up step failed", exc_info=error)
        cause = next(iter(str(error).strip().splitlines()), "")
        backends = parts.backends
        raise ValueError(f"the warm-up step failed on --device {config.device} ({config.torch_device}) with "
                         f"--attention-backend {backends.attention}, --lora-backend {backends.lora} and "
                         f"--linear-backend {backends.linear}: {type(error).__name__}: {cause}") from error


def _image_token_id(config: DecoderConfig, model_config: dict, tokenizer) -> int | None:
    if config.mrope_section is None:
        return None
    if config.image_token is None:
        return int(model_config["image_token_id"])
    token_id = tokenizer.convert_tokens_to_ids(config.image_token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"image_token {config.image_token!r} is not in the vocabulary")
    return int(token_id)


def _eos_token_ids(config: DecoderConfig, model_config: dict) -> set[int]:
    """The EOS ids of config.json (a VLM's text config) and generation_config.json, together."""
    ids: set[int] = set()
    sources = [text_config(model_config).get("eos_token_id")]
    gen_path = Path(config.model_dir) / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids
