"""Decoder configuration: one dataclass, validated once."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.checkpoint import MODEL_IMPLS, CheckpointConfig, check_decoder_dir, decoder_impl
from services.common.device import DEVICE_HELP, resolve_device
from services.common.limits import GenerateLimits
from services.common.liveness import DEFAULT_WEDGED_AFTER_S, check_wedged_after_s
from services.common.metrics import check_metrics_port
from services.common.mrope import check_checkpoint_section, check_mrope_section, parse_mrope_section
from services.common.server import default_address
from services.common.sizes import format_bytes, parse_bytes
from services.decoder.attention import ATTENTION_BACKENDS
from services.decoder.decode_step import DECODE_STEPS
from services.decoder.kernels import native
from services.decoder.kv_cache import KVBlockLayout
from services.decoder.linear import LINEAR_BACKENDS
from services.decoder.lora.registry import LORA_BACKENDS, check_dtype
from services.decoder.model_llama import quantized_types
from services.decoder.model_qwen2_vl import is_qwen2_vl, text_config
from services.decoder.model_qwen2_vl import mrope_section as checkpoint_mrope_section
from services.decoder.quant import QUANT_MODES
from services.decoder.tools import PARSER_AUTO, PARSER_NONE, TOOL_CALL_PARSERS
from services.decoder.types import GenerationDefaults
from tessera.paths import default_decoder_dir
from tessera.protocol import DECODER_DEVICE_ENV

DTYPES = ("float32", "float16", "bfloat16", "float64")
AUTO = "auto"  # dtype: the checkpoint's (resolve_dtype); backends: the fastest that runs (their registries)
log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192
GENERATION_CONFIG_AUTO, GENERATION_CONFIG_VLLM = "auto", "vllm"  # --generation-config's named values


def _flag(default, help_text: str, **metadata):
    """A config field with its command-line flag (services/common/config_cli.py)."""
    return field(default=default, metadata={"help": help_text, **metadata})


@dataclass
class DecoderConfig:
    """Everything the decoder needs to start.

    `num_blocks` and `max_model_len` default from the model (0 = derive): max_model_len is
    min(max_position_embeddings, 8192); num_blocks holds max_num_seqs * max_model_len / 4 tokens
    capped at 2048 blocks. `kv_cache_memory_bytes` (bytes; the flag takes "2GiB", "512MB": services/common/sizes.py)
    sizes the KV cache from a memory budget instead, as vLLM's `--kv-cache-memory-bytes`: num_blocks =
    budget // bytes per block (num_layers x 2 x block_size x num_kv_heads x head_dim x the cache dtype's
    size, `KVBlockLayout`), pure arithmetic on config.json and the resolved dtype; a budget that cannot hold
    one sequence of max_model_len tokens is refused naming the bytes it needs, and giving it with
    `num_blocks` is refused (one of the two sizes the cache). `mrope_section` (pairs per axis t, h, w summing to head_dim / 2) turns on
    image inputs (a Qwen2-VL checkpoint fixes it from config.json; a differing value is refused); `image_token` names the placeholder token (or config.json has image_token_id).
`kv_cache_dtype` (vLLM's flag): "auto" (default) stores the model's dtype; "bfloat16" under a float32
model rounds K/V to bfloat16 as they are written and widens them as attention reads them (every
attention backend and the fused decode step), halving the cache's bytes per block.
`enable_prefix_caching` shares the KV of full prompt blocks between requests (block hash chain).
`dtype`: "auto" (default) follows the checkpoint's config.json (`resolve_dtype`); resolved here.
`attention_backend`, `lora_backend`: "auto" (default) resolves when the engine starts
(engine_parts.py `resolve_backends`; building the config builds nothing) to the fastest that runs:
"triton" on a CUDA device, "cpu" on the CPU where the C kernels build (kernels/native.py, built
then) and compute the dtype (float32, bfloat16), else "torch". Attention: "torch" (any device),
"triton" (paged attention kernel; needs a GPU, or TRITON_INTERPRET=1 on CPU, and a power-of-two
block_size) or "cpu" (decode rows in a C kernel; faster decode attention than the torch path on
long contexts: bench/results/kernels.md).
`linear_backend`: "auto" (default) resolves at start to "cpu" (the C GEMM on packed weights,
services/decoder/linear.py, and the C RMSNorm, rotary and SiLU gate, kernels/pointwise.py) on a CPU without
AVX-512 where the kernels build, else "torch"; on a GPU "triton" for a checkpoint holding GGUF blocks
(dense weights through torch, the blocks through kernels/quant_triton.py's dequantize-in-the-GEMM kernels).
`decode_step`: "auto" (default) resolves when the model runner is built (decode_step.py `attach_decode_step`)
to "fused" (all-decode steps of a Llama-family model in one C call on the cpu attention backend) where
`why_not` finds no reason against it, else "modules"; "fused" where it cannot run is refused then.
`quant_mode`: "exact" (default) or "fast", for a checkpoint holding GGUF blocks (services/decoder/quant.py);
such a checkpoint is served on the CPU in float32 (dtype "auto" resolves to it), or with --linear-backend
triton (CUDA, or TRITON_INTERPRET=1) in exact mode, float32 or half precision.
`wedged_after_s`: seconds with requests queued and no engine step completed before health says
NOT_SERVING (services/common/liveness.py); it must exceed the longest step.
`limits`: caps on each Generate request, checked on the protobuf before tokenizing
(services/common/limits.py); its prompt character cap defaults to 32 x max_model_len.
`address`: host:port the decoder binds.
`device`: auto, cpu, cuda or cuda:N, resolved once into `torch_device` (services/common/device.py;
auto is the CPU when a cpu backend is chosen); weights, KV cache, adapter slots and sampling live
there. The triton backends need a CUDA device (or TRITON_INTERPRET=1), the cpu backends the CPU:
another pairing is refused here, naming the flag.
`served_model_name`: the names the model answers to (vLLM's --served-model-name NAME [ALIAS ...]);
empty = the checkpoint directory's name (`served_model_names`).
`generation_config` (vLLM's flag): where the sampling defaults for fields a request leaves unset
come from, read once here into `generation_defaults`: "auto" the checkpoint's
generation_config.json (none when it has none), a directory holding a generation_config.json, or
"vllm" none (every unset field neutral). The model's EOS ids come from the checkpoint either way.
`tool_call_parser` (vLLM's flag): the format the model's tool calls are parsed from, which
DecoderInfo reports for the gateway's `tool_choice: "auto"`: "auto" (default) "hermes" when the
chat template mentions `<tool_call>` (Hermes, Qwen2.5, Qwen3, SmolLM3), else none;
"hermes"; or "none" (services/decoder/tools.py).
Structured output (services/decoder/grammar.py): a constraint's compile taking longer than
`structured_outputs_compile_timeout` seconds is refused; at most `structured_outputs_cache_size`
compiled grammars are kept (least recently used first out).
    """

    model_dir: str = _flag(str(default_decoder_dir()), "checkpoint directory")
    block_size: int = _flag(16, "tokens per KV-cache block")
    num_blocks: int = _flag(0, "KV-cache blocks; 0 = from --kv-cache-memory-bytes when given, else enough for "
                               "max_num_seqs * max_model_len / 4 tokens, at most 2048")
    kv_cache_memory_bytes: int = _flag(0, "KV-cache budget in bytes (suffixes KiB, MiB, GiB or KB, MB, GB: 2GiB): "
                                    "num_blocks = budget // bytes per block (layers x K,V x block_size x kv heads "
                                    "x head_dim x the cache dtype's size); 0 = --num-blocks decides", type=parse_bytes,
                                 metavar="BYTES")
    kv_cache_dtype: str = _flag(AUTO, "dtype the KV cache stores (vLLM's --kv-cache-dtype): auto = the model's; "
                                      "bfloat16 on a float32 model halves the cache's bytes (K/V rounded to "
                                      "bfloat16 as they are written, widened as attention reads them)",
                                choices=(AUTO, "bfloat16"))
    max_num_seqs: int = _flag(32, "most sequences in one step")
    max_num_batched_tokens: int = _flag(2048, "most tokens in one step")
    max_model_len: int = _flag(0, "context length in tokens; 0 = min(max_position_embeddings, 8192)")
    max_waiting: int = _flag(256, "most queued requests before RESOURCE_EXHAUSTED")
    mrope_section: tuple[int, int, int] | None = _flag(None, 'M-RoPE pairs per (t,h,w) axis, e.g. "8,12,12"; '
                                                             "empty = text-only", type=parse_mrope_section)
    image_token: str | None = _flag(None, "the placeholder token for image rows")
    adapters_address: str | None = _flag(None, "the adapter registry host:port; empty = no adapters",
                                         type=lambda text: text or None)
    adapter_slots: int = _flag(8, "adapters resident at once")
    max_lora_rank: int = _flag(64, "largest LoRA rank a slot holds")
    lora_backend: str = _flag(AUTO, "multi-LoRA compute: auto (triton on a GPU, cpu where its C kernel builds, "
                                     "else torch), torch grouped matmuls, Triton BGMV/SGMV kernels (GPU or "
                                     "TRITON_INTERPRET=1), or cpu: every adapter row in a C BGMV kernel (float32, bfloat16)",
                              choices=(AUTO, *LORA_BACKENDS))
    lora_dtype: str = _flag(AUTO, "dtype of the LoRA factors in the slots (vLLM's --lora-dtype): auto = the model's; "
                                   "bfloat16 on a float32 model halves the bytes each decode step's BGMV reads "
                                   "(factors rounded to bfloat16 once, at load; cpu and torch LoRA backends)",
                            choices=(AUTO, "float32", "bfloat16"))
    adapter_host_cache_mb: int = _flag(1024, "host memory for adapter weights by digest (swap-ins without "
                                             "refetching)")
    model_impl: str = _flag(AUTO, "how the model runs: auto (native where tessera has the family, else transformers), "
                                  "native (tessera's model file), or transformers (transformers' modeling code on "
                                  "the paged KV cache); resolved at start", choices=MODEL_IMPLS)
    dtype: str = _flag(AUTO, f"model dtype: auto (the checkpoint's; on a CPU, bfloat16 and float16 serve as "
                             f"bfloat16 where it computes bf16 natively, else float32; none declared: float32) "
                             f"or one of {', '.join(DTYPES)}")
    enable_prefix_caching: bool = _flag(True, "share KV blocks of full prompt blocks between requests",
                                        flag="--prefix-caching")
    attention_backend: str = _flag(AUTO, "paged attention implementation: auto (triton on a GPU, cpu where its C "
                                         "kernel builds, else torch); triton needs a GPU (or TRITON_INTERPRET=1); "
                                         "cpu: decode rows and prefill spans in C kernels (needs a C compiler with OpenMP; float32, "
                                         "bfloat16)",
                                   choices=(AUTO, *ATTENTION_BACKENDS))
    linear_backend: str = _flag(AUTO, "dense projections, lm_head, RMSNorm, rotary and the MLP's SiLU gate: auto "
                                      "(cpu where its C kernels build unless torch's GEMM runs AVX-512 code for the "
                                      "dtype here: MKL float32 on Intel, oneDNN bfloat16 with AVX512-BF16 or AMX; "
                                      "then torch's GEMM with the C RMSNorm, rotary and SiLU gate), torch "
                                      "(MKL / oneDNN and torch's elementwise ops), cpu: a C GEMM on weights packed at load, every step (float32; "
                                      "bfloat16 weights read directly), and C RMSNorm, rotary and SiLU-gate kernels, "
                                      "or triton: GGUF blocks through Triton dequantize-in-the-GEMM kernels (GPU or "
                                      "TRITON_INTERPRET=1), dense weights through torch",
                                choices=(AUTO, *LINEAR_BACKENDS))
    decode_step: str = _flag(AUTO, "all-decode steps of up to 32 rows (with row-major weights: 16 float32, bfloat16 8 with AMX): fused (every layer "
                                   "in one C call: kernels/decode_step.c; Llama-family models on the cpu attention "
                                   "backend), modules (layer by layer through the model's modules, the reference), "
                                   "or auto (fused where it runs, else modules)", choices=(AUTO, *DECODE_STEPS))
    quant_mode: str = _flag("exact", "how matrices kept as GGUF blocks (models import --keep-quantized) multiply: "
                                     "exact (weights widened to float32 in registers, float32 activations: the "
                                     "dequantized model's numbers up to summation order) or fast (activations "
                                     "quantized to int8 per 32-element block, as llama.cpp does; integer dot "
                                     "products, VNNI where the CPU has it)", choices=QUANT_MODES)
    metrics_port: int = _flag(0, "serve Prometheus /metrics on this port, same host as --address; 0 = off")
    wedged_after_s: float = _flag(DEFAULT_WEDGED_AFTER_S, "health turns NOT_SERVING when requests are queued and "
                                  "no engine step completes for this long (seconds; must exceed the longest step)")
    limits: GenerateLimits = field(default_factory=GenerateLimits)
    address: str = _flag(default_address("decoder"), "bind host:port")
    device: str = _flag("auto", DEVICE_HELP, env=DECODER_DEVICE_ENV)
    served_model_name: tuple[str, ...] = _flag((), "the model's name in requests and answers, then aliases "
                                               "also accepted", nargs="+", metavar=("NAME", "ALIAS"),
                                               default_help="the model directory's name")
    generation_config: str = _flag(GENERATION_CONFIG_AUTO, "sampling defaults for fields a request leaves "
                                   "unset (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens): "
                                   "auto (the checkpoint's generation_config.json), vllm (none: neutral values) or "
                                   "a directory holding a generation_config.json")
    tool_call_parser: str = _flag(PARSER_AUTO, "the format tool calls are parsed from for tool_choice auto: auto "
                                  "(hermes when the chat template mentions <tool_call>, else none), hermes "
                                  "(<tool_call>{json}</tool_call>) or none",
                                  choices=(PARSER_AUTO, *TOOL_CALL_PARSERS, PARSER_NONE))
    structured_outputs_compile_timeout: float = _flag(5.0, "seconds a structured-output constraint may take to "
                                                      "compile before its request is refused")
    structured_outputs_cache_size: int = _flag(256, "compiled structured-output grammars kept (least recently "
                                               "used first out)")
    torch_device: torch.device = field(init=False, repr=False, compare=False)  # `device` resolved, once
    checkpoint: CheckpointConfig = field(init=False, repr=False, compare=False)  # config.json, read once
    generation_defaults: GenerationDefaults = field(init=False, repr=False, compare=False)  # read once
    quantized: bool = field(init=False, repr=False, compare=False)  # the checkpoint holds GGUF blocks

    def __post_init__(self) -> None:
        self._check_values()
        self._check_served_names()
        self._check_device()
        self._derive_from_checkpoint()
        self.generation_defaults = self._read_generation_defaults()
        self._resolve_dtype(self.torch_device)
        if self.kv_cache_memory_bytes:
            self.num_blocks = self._blocks_for_budget()

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The model's name (first) and its aliases: --served-model-name, else the directory's name."""
        return self.served_model_name or (Path(self.model_dir).name,)

    def _check_served_names(self) -> None:
        self.served_model_name = tuple(self.served_model_name)
        for name in self.served_model_name:
            if not name.strip():
                raise ValueError(f"served_model_name holds an empty name: {list(self.served_model_name)}")
        if len(set(self.served_model_name)) < len(self.served_model_name):
            raise ValueError(f"served_model_name names one model twice: {list(self.served_model_name)}")

    def _read_generation_defaults(self) -> GenerationDefaults:
        """The sampling defaults `generation_config` names (see the class docstring).

        Raises:
            ValueError: a directory without a readable generation_config.json, a file that is not a
                JSON object, or a value out of range (naming the file and the key).
        """
        if self.generation_config == GENERATION_CONFIG_VLLM:
            return GenerationDefaults()
        auto = self.generation_config == GENERATION_CONFIG_AUTO
        path = Path(self.model_dir if auto else self.generation_config).expanduser() / "generation_config.json"
        if auto and not path.is_file():
            return GenerationDefaults()
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"generation_config {self.generation_config!r}: no readable {path}: {error}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object")
        defaults = GenerationDefaults.from_generation_config(raw, str(path))
        if defaults.as_dict():
            log.info("sampling defaults from %s for fields a request leaves unset: %s", path, defaults.as_dict())
        return defaults

    def _check_device(self) -> None:
        """Resolve `device` ("auto" is the CPU when a cpu backend is chosen); refuse a backend that
        cannot compute there (triton: CUDA or Triton's interpreter; cpu: the CPU), naming its flag."""
        cpu_backend = "cpu" in (self.attention_backend, self.lora_backend, self.linear_backend)
        self.torch_device = resolve_device("cpu" if self.device == "auto" and cpu_backend else self.device)
        on_cuda = self.torch_device.type == "cuda"
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        for flag, backend in (("--attention-backend", self.attention_backend), ("--lora-backend", self.lora_backend),
                              ("--linear-backend", self.linear_backend)):
            if backend == "triton" and not (on_cuda or interpreted):
                where = f"--device is {self.device}" if torch.cuda.is_available() else "this machine has none"
                raise ValueError(f"{flag} triton needs a CUDA device or TRITON_INTERPRET=1; {where}")
            if backend == "cpu" and on_cuda:
                raise ValueError(f"{flag} cpu computes on the CPU; --device is {self.device} ({self.torch_device}); "
                                 f"use --device cpu or another {flag}")

    def _check_structured_outputs(self) -> None:
        if not self.structured_outputs_compile_timeout > 0:
            raise ValueError(f"--structured-outputs-compile-timeout must be > 0 seconds, got "
                             f"{self.structured_outputs_compile_timeout}")
        if self.structured_outputs_cache_size < 1:
            raise ValueError(f"--structured-outputs-cache-size must be >= 1, got {self.structured_outputs_cache_size}")

    def _check_values(self) -> None:
        """Checks that need no checkpoint: ranges, registered backends, dtype."""
        check_metrics_port(self.metrics_port)
        check_wedged_after_s(self.wedged_after_s)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting",
                     "adapter_slots", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size > 1024:
            raise ValueError(f"block_size must be <= 1024, got {self.block_size}")
        self._check_structured_outputs()
        parsers = (PARSER_AUTO, *TOOL_CALL_PARSERS, PARSER_NONE)
        if self.tool_call_parser not in parsers:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(parsers)}, got {self.tool_call_parser!r}")
        if self.kv_cache_memory_bytes < 0:
            raise ValueError(f"--kv-cache-memory-bytes must be >= 0 bytes (0 = --num-blocks decides), got "
                             f"{self.kv_cache_memory_bytes}")
        if self.kv_cache_memory_bytes and self.num_blocks:
            raise ValueError(f"--num-blocks {self.num_blocks} and --kv-cache-memory-bytes {self.kv_cache_memory_bytes} both "
                             "size the KV cache; give one of them")
        if self.num_blocks < 0 or self.max_model_len < 0:
            raise ValueError(f"num_blocks and max_model_len must be >= 0 (0 = derive), got "
                             f"{self.num_blocks} and {self.max_model_len}")
        if self.adapter_host_cache_mb < 0:
            raise ValueError(f"adapter_host_cache_mb must be >= 0, got {self.adapter_host_cache_mb}")
        for name, choices in (("lora_backend", LORA_BACKENDS), ("attention_backend", ATTENTION_BACKENDS),
                              ("linear_backend", LINEAR_BACKENDS), ("decode_step", DECODE_STEPS),
                              ("kv_cache_dtype", ("bfloat16",)), ("dtype", DTYPES)):
            if getattr(self, name) not in (AUTO, *choices):
                raise ValueError(f"{name} must be one of {(AUTO, *choices)}, got {getattr(self, name)!r}")
        if self.dtype != AUTO:  # refused before config.json is read; "auto" is checked once resolved
            self._check_backends_take_dtype()

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's dtype: `kv_cache_dtype`, "auto" being the model's (`dtype`, resolved)."""
        return getattr(torch, self.dtype if self.kv_cache_dtype == AUTO else self.kv_cache_dtype)

    @property
    def lora_torch_dtype(self) -> torch.dtype:
        """The LoRA slots' dtype: `lora_dtype`, "auto" being the model's (`dtype`, resolved)."""
        return getattr(torch, self.dtype if self.lora_dtype == AUTO else self.lora_dtype)

    def _check_backends_take_dtype(self) -> None:
        if self.kv_cache_dtype not in (AUTO, self.dtype) and self.dtype != "float32":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} does not fit dtype {self.dtype!r}: the cache "
                             "stores the model's dtype, or bfloat16 under a float32 model")
        if self.lora_dtype not in (AUTO, self.dtype) and (self.dtype, self.lora_dtype) != ("float32", "bfloat16"):
            raise ValueError(f"lora_dtype {self.lora_dtype!r} does not fit dtype {self.dtype!r}: a model's factors are "
                             "its dtype, or bfloat16 on a float32 model")
        if self.lora_dtype not in (AUTO, self.dtype) and self.lora_backend == "triton":
            raise ValueError(f"the triton LoRA backend computes factors of the model's dtype, not lora_dtype "
                             f"{self.lora_dtype!r} on dtype {self.dtype!r} (--lora-backend cpu or torch)")
        if self.attention_backend != AUTO:
            ATTENTION_BACKENDS[self.attention_backend].check_config(self.block_size, self.dtype)
        if self.lora_backend != AUTO:
            check_dtype(self.lora_backend, self.dtype)
        if self.linear_backend == "cpu" and self.dtype not in native.DTYPES:
            raise ValueError(f"the cpu linear backend computes {' and '.join(native.DTYPES)} only, got dtype "
                             f"{self.dtype!r}")

    def _resolve_dtype(self, device: torch.device) -> None:
        """dtype "auto" from the checkpoint (`resolve_dtype`), then the explicit backends checked
        against it. The "auto" backends stay "auto": the engine chooses them when it starts
        (services/decoder/engine_parts.py `resolve_backends`), as that may build the C kernels."""
        if self.quant_mode not in QUANT_MODES:
            raise ValueError(f"quant_mode must be one of {QUANT_MODES}, got {self.quant_mode!r}")
        quantized = self.quantized = bool(quantized_types(self.checkpoint.model_dir))
        if self.dtype == AUTO:
            self.dtype = "float32" if quantized else resolve_dtype(self.checkpoint.raw, device)
            log.info("dtype auto: %s (checkpoint %s%s)", self.dtype, checkpoint_dtype(self.checkpoint.raw),
                     ", GGUF-quantized matrices" if quantized else "")
            self._check_backends_take_dtype()
        if not quantized:
            return
        if self.linear_backend == "triton" or (self.linear_backend == AUTO and device.type != "cpu"):
            if self.dtype == "float64":
                raise ValueError("the Triton quantized GEMM computes float32, float16 or bfloat16, not dtype 'float64'")
            if self.quant_mode != "exact":
                raise ValueError(f"--quant-mode {self.quant_mode} is the CPU kernels' (int8 activations); the Triton "
                                 "kernels of --linear-backend triton multiply GGUF blocks in exact mode only")
        elif self.dtype != "float32" or device.type != "cpu":
            raise ValueError(f"{self.model_dir} holds GGUF-quantized matrices: they are served on the CPU with float32 "
                             f"activations (dtype float32 or auto), or by --linear-backend triton (CUDA), not dtype "
                             f"{self.dtype!r} on {device} with --linear-backend {self.linear_backend}")

    def _check_family_config(self) -> None:
        """Read config.json as the model will, before the tokenizer or any weight loads: transformers'
        config class for its model_type (AutoTokenizer builds it too, and its strict field checks
        would otherwise surface as a traceback there) and, on the native path, the family's spec
        (`spec_from_config`: windows, soft-caps, experts, RoPE). Raises ValueError in one line naming the field."""
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        from services.decoder.models import family_class

        raw, model_type = dict(self.checkpoint.raw), self.checkpoint.model_type
        if model_type in CONFIG_MAPPING:
            try:
                CONFIG_MAPPING[model_type].from_dict(raw)
            except Exception as error:  # noqa: BLE001 - strict dataclass, type and value errors: each names the field
                raise ValueError(f"config.json is not a {model_type} config transformers reads: "
                                 f"{' '.join(str(error).split())}") from None
        if self.model_impl == "native" and not is_qwen2_vl(raw):
            family_class(model_type).spec_from_config(raw)

    def _derive_from_checkpoint(self) -> None:
        """M-RoPE sections, max_model_len and num_blocks from the checkpoint's config.json."""
        self.checkpoint = check_decoder_dir(self.model_dir, self.model_impl)  # the one read of config.json
        self.model_impl = decoder_impl(self.checkpoint, self.model_impl)  # "native" or "transformers"
        self._check_family_config()
        outer = dict(self.checkpoint.raw)
        model = text_config(outer)  # Qwen2-VL nests its language model's config
        if is_qwen2_vl(outer):  # sections fixed by the checkpoint; a differing flag is refused
            self.mrope_section = check_checkpoint_section(self.mrope_section, checkpoint_mrope_section(outer))
        limit = int(model.get("max_position_embeddings", DEFAULT_MAX_MODEL_LEN))
        if self.model_impl == "transformers":  # its own name for it too (GPT-2's n_positions)
            from services.decoder.model_transformers import max_positions

            limit = max_positions(self.model_dir) or limit
        if self.max_model_len == 0:
            self.max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        if self.num_blocks == 0 and not self.kv_cache_memory_bytes:
            tokens = self.max_num_seqs * self.max_model_len // 4
            self.num_blocks = max(1, min(2048, -(-tokens // self.block_size)))
        if self.mrope_section is not None:
            if self.model_impl == "transformers":
                raise ValueError(f"mrope_section {self.mrope_section}: the transformers model_impl serves text only")
            self._check_mrope(model)

    def kv_block_layout(self) -> KVBlockLayout:
        """One KV block's shape and dtype for this checkpoint (its language model's config.json; on the
        transformers path as transformers' config class reads it: GPT-2's n_layer, n_head)."""
        if self.model_impl == "transformers":
            from services.decoder.model_transformers import kv_shape

            num_layers, num_kv_heads, head_dim = kv_shape(self.model_dir)
            return KVBlockLayout(num_layers, self.block_size, num_kv_heads, head_dim, self.kv_cache_torch_dtype)
        checkpoint = self.checkpoint
        return KVBlockLayout(checkpoint.num_hidden_layers, self.block_size, checkpoint.num_key_value_heads,
                             checkpoint.head_dim, self.kv_cache_torch_dtype)

    def _blocks_for_budget(self) -> int:
        """num_blocks for `kv_cache_memory_bytes` bytes. Raises ValueError: the budget holds fewer blocks
        than one sequence of max_model_len tokens needs (naming both sizes)."""
        layout = self.kv_block_layout()
        per_block = layout.bytes_per_block
        num_blocks = self.kv_cache_memory_bytes // per_block
        needed_blocks = -(-self.max_model_len // self.block_size)
        if num_blocks < needed_blocks:
            raise ValueError(f"--kv-cache-memory-bytes {format_bytes(self.kv_cache_memory_bytes)} holds {num_blocks} KV blocks "
                             f"of {per_block} bytes ({layout.describe()}); one sequence of max_model_len "
                             f"{self.max_model_len} tokens needs {needed_blocks} blocks, "
                             f"{format_bytes(needed_blocks * per_block)}: raise --kv-cache-memory-bytes or lower "
                             "--max-model-len")
        log.info("KV cache: --kv-cache-memory-bytes %s holds %d blocks of %d bytes (%s)", format_bytes(self.kv_cache_memory_bytes),
                 num_blocks, per_block, layout.describe())
        return num_blocks

    def _check_mrope(self, model: dict) -> None:
        head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
        self.mrope_section = check_mrope_section(self.mrope_section, head_dim)
        if self.image_token is None and model.get("image_token_id") is None:
            raise ValueError("mrope_section needs image_token (a token in the vocabulary) "
                             "because config.json has no image_token_id")


def checkpoint_dtype(raw: Mapping) -> str | None:
    """The dtype config.json declares (`torch_dtype`, or `dtype` as transformers 5 writes it; top
    level, else a vision-language model's text_config), as a torch dtype name; None if none."""
    for scope in (raw, raw.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            value = scope.get(key)
            if isinstance(value, str) and value:
                return value.removeprefix("torch.")
    return None


def resolve_dtype(raw: Mapping, device: torch.device) -> str:
    """The model dtype "auto" stands for with checkpoint config `raw` on `device`: the checkpoint's
    declared dtype, as transformers and vLLM follow it, except for half precision on a CPU. There a
    bfloat16 or float16 checkpoint serves as bfloat16 where the CPU computes bf16 natively (AVX512-BF16
    or AMX; vLLM casts float16 so too) and as float32 elsewhere: emulated half-precision matmuls are
    slower than float32 (bf16 P1 ran at 0.36x of float32 on an AVX2-only CPU: bench/results/peer.md),
    and widening bf16 or fp16 to float32 is exact. None declared, or one tessera does not load:
    float32 (transformers' default). float32 checkpoints stay float32."""
    declared = checkpoint_dtype(raw)
    if declared not in DTYPES:
        return "float32"
    if declared in ("float16", "bfloat16") and device.type == "cpu":
        return "bfloat16" if native.cpu_has_bf16() else "float32"
    return declared
