"""Llama causal LM over a flat token batch and a paged KV cache; the base of the Qwen2 and Qwen3 files.

RMSNorm, SiLU-gated MLP, GQA, default, scaled (linear, dynamic, yarn, llama3; rotary.py) or M-RoPE,
tied or untied lm_head, optional biases (`attention_bias`, `mlp_bias`) as in transformers'
LlamaForCausalLM. Sliding-window layers, longrope and a partial rotary factor are refused. The
lm_head follows transformers 5: with `tie_word_embeddings` it is the embeddings unless the file
holds an `lm_head.weight` that differs from them, which is kept. Weights load by name from `model.safetensors` (or a sharded index) with the HF
`config.json`; module names match transformers, so "model.layers.0.self_attn.q_proj" is both a
weight prefix and a LoRA target name. At load, each layer's q/k/v and gate/up projections are
concatenated into one wider projection each (`qkv_proj`, `gate_up_proj`: two GEMMs where the
checkpoint has five, with fewer dispatches and one pass over the input each); LoRA still targets
the checkpoint's names, each on its columns of the fused output. A family differs by
`spec_from_config` and its attention class (model_qwen2.py: q/k/v bias; model_qwen3.py: q/k
RMSNorm through `normalize_qk`; model_smollm3.py: NoPE layers through `rotate_qk`), and where its
block differs, its decoder layer class (`layer_cls`: model_granite.py, model_olmo2.py) and the
cos/sin dtype (`rotary_dtype`); `load_model` (models.py) picks the family from config.json's model_type.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from services.common.checkpoint import QUANTIZATION_METADATA, CheckpointConfig, check_rope_type, rope_settings
from services.common.memory import release_file_pages
from services.decoder.attention import AttentionBackend, AttentionMetadata
from services.decoder.kernels.pointwise import CpuPointwise
from services.decoder.kv_cache import KVCache
from services.decoder.linear import Linear
from services.decoder.lora import LoRALinear
from services.decoder.quantized_model import attach_quantized, dequantize_into, split_quantized
from services.decoder.rotary import RopeScaling, RotaryEmbedding, apply_rotary

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaSpec:
    """The architecture facts read from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None  # None: default RoPE of rope_theta

    def extended(self, spec_cls, **values):
        """A family's spec (`spec_cls`, a LlamaSpec subclass) holding this spec's fields, with `values`
        adding the family's own fields (or replacing one of these)."""
        return spec_cls(**{**{f.name: getattr(self, f.name) for f in fields(LlamaSpec)}, **values})

    @classmethod
    def from_config(cls, cfg: dict) -> LlamaSpec:
        """Llama's reading of config.json (biases from `attention_bias` / `mlp_bias`).

        Raises ValueError for unsupported activations, RoPE types, a partial rotary factor or
        sliding-window layers.
        """
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported; expected 'silu'")
        rope_type, rope_theta = rope_settings(cfg)  # transformers' reading of rope_scaling / rope_parameters
        check_rope_type(rope_type)
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor {partial!r} is not supported: transformers' Llama, Qwen2 and "
                             "Qwen3 rotate the whole head")
        if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or ()):
            raise ValueError("sliding-window attention layers are not supported")
        heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=(cfg.get("architectures") or ["LlamaForCausalLM"])[0],
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            rope_scaling=None if rope_type == "default" else RopeScaling.from_config(cfg, rope_type),
        )


def positive_or_none(name: str, value, integer: bool = False):
    """config.json's `name` when it is None or a positive finite number (an int where `integer`: a
    window counts keys). Raises ValueError naming the field and the value otherwise (0 would empty a
    window or divide by zero in a soft-cap or an attention scale; NaN would reach every logit)."""
    kinds = int if integer else (int, float)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < math.inf:
        kind = "a positive integer" if integer else "a positive finite number"
        raise ValueError(f"config.json's {name} must be {kind} or null, got {value!r}")
    return value


def _linear(prefix: str, in_f: int, parts: tuple[tuple[str, int], ...], bias: bool) -> LoRALinear:
    """One projection computing the checkpoint projections `parts` ((name, out_features), ...)
    side by side: a single wider GEMM where the checkpoint has several (see `fuse_projections`)."""
    slices, start = [], 0
    for name, out_f in parts:
        slices.append((f"{prefix}.{name}", start, start + out_f))
        start += out_f
    layer = LoRALinear(in_f, start, bias=bias)
    layer.lora_slices = tuple(slices)
    return layer


# fused module -> the checkpoint projections it concatenates along the output dimension, in order
FUSED_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(state: dict[str, torch.Tensor], num_layers: int) -> None:
    """Concatenate each layer's q/k/v and gate/up weights (and biases) in `state` (HF names) into
    the fused modules' entries, in place; the parts' entries are removed and their file pages
    released (`release_file_pages`: the parts are read once, here). A layer missing a part is left
    as it is (the caller's name check reports it)."""
    for layer in range(num_layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{layer}.{part}.{kind}" for part in parts]
                if all(name in state for name in names):
                    tensors = [state.pop(n) for n in names]
                    state[f"model.layers.{layer}.{fused}.{kind}"] = torch.cat(tensors)
                    release_file_pages(tensors)


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm; in the C kernel once `attach_pointwise` set `pointwise`."""

    pointwise: CpuPointwise | None = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pointwise is not None:
            return self.pointwise.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused kernel; the same values as below in float32
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype  # transformers' order: normalize in float32, round, then scale in `dtype`
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # statistics in float32
        return self.weight * x.to(dtype)


class LlamaAttention(nn.Module):
    """Self-attention of one layer. `sliding_window` and `logits_soft_cap` (None here: full causal,
    no cap) are set per layer by a family's attention class or constructor and passed to the backend,
    whose `AttentionBackend.forward` states their conventions (transformers')."""

    pointwise: CpuPointwise | None = None  # the C rotary kernel, set by `attach_pointwise`
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    def __init__(self, spec: LlamaSpec, layer: int) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}.self_attn"
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.layer, self.num_heads, self.num_kv_heads, self.head_dim = layer, h, kv, d
        self.scale = d ** -0.5
        self.qkv_proj = _linear(prefix, spec.hidden_size, (("q_proj", h * d), ("k_proj", kv * d), ("v_proj", kv * d)),
                                spec.qkv_bias)
        self.o_proj = _linear(prefix, h * d, (("o_proj", spec.hidden_size),), spec.o_bias)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook between projection and RoPE: identity here (Qwen3 normalizes per head)."""
        return q, k

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook applying RoPE to q [n, heads, head_dim] and k [n, kv_heads, head_dim] by cos/sin
        [n, head_dim] (rotate_half pairing); a family overrides it to skip or re-type the rotation."""
        rotate = apply_rotary if self.pointwise is None else self.pointwise.rotary
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                attention: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = q.view(n, self.num_heads, d)     # [n, heads, head_dim], column views of [n, (heads + 2 kv) d]
        k = k.view(n, self.num_kv_heads, d)  # [n, kv_heads, head_dim]
        v = v.view(n, self.num_kv_heads, d)
        q, k = self.normalize_qk(q, k)
        q, k = self.rotate_qk(q, k, cos, sin)
        attention.write_kv(cache, self.layer, k, v, meta)
        k_cache, v_cache = cache.layer(self.layer)  # [kv_heads, slots, head_dim]
        out = attention.forward(q, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window,
                                logits_soft_cap=self.logits_soft_cap)  # [n, heads, head_dim]
        return self.o_proj(out.reshape(n, -1))


class LlamaMLP(nn.Module):
    pointwise: CpuPointwise | None = None  # the C SiLU gate, set by `attach_pointwise`

    def __init__(self, spec: LlamaSpec, layer: int, prefix: str | None = None) -> None:
        """`prefix`: the checkpoint name of this MLP (default "model.layers.{layer}.mlp"; a MoE
        block's shared expert lives under its own)."""
        super().__init__()
        prefix = prefix or f"model.layers.{layer}.mlp"
        hs, inter, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.intermediate_size = inter
        self.gate_up_proj = _linear(prefix, hs, (("gate_proj", inter), ("up_proj", inter)), bias)
        self.down_proj = _linear(prefix, inter, (("down_proj", hs),), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [n, 2 * inter]: gate, then up
        if self.pointwise is not None:  # one pass, a contiguous [n, inter] for the down projection
            return self.down_proj(self.pointwise.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, -1)  # column views
        # in place: no new [tokens, intermediate] buffer (at 2048 prefill tokens one is 12 MB)
        return self.down_proj(nn.functional.silu(gate, inplace=True).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, layer: int, attention_cls: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__()
        self.self_attn = attention_cls(spec, layer)
        self.mlp = LlamaMLP(spec, layer)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, cos, sin, cache, attention, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, attention, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, spec: LlamaSpec, attention_cls: type[LlamaAttention] = LlamaAttention,
                 layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(layer_cls(spec, i, attention_cls) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward: flat batch -> last layer's residual stream; compute_logits: selected rows -> final
    norm -> logits."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # cos/sin dtype; None: the activations' (transformers' Llama casts them; OLMo 2 keeps float32)
    rotary_dtype: torch.dtype | None = None
    # the fused decode step (decode_step.py), set by the model runner where it runs this model:
    # all-decode steps it `accepts` skip the per-module loop below
    fused_decode = None

    @classmethod
    def spec_from_config(cls, cfg: dict) -> LlamaSpec:
        """The family's reading of config.json. Raises ValueError for what the family cannot run."""
        return LlamaSpec.from_config(cfg)

    @classmethod
    def convert_checkpoint(cls, spec: LlamaSpec, state: dict[str, torch.Tensor]) -> None:
        """Hook: rewrite `state` (the file's names) in place into this family's weight names before
        `build_model` checks them (nothing here; MoE families stack their per-expert weights)."""

    def __init__(self, spec: LlamaSpec, mrope_section: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.model = LlamaModel(spec, self.attention_cls, self.layer_cls)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta, mrope_section, spec.rope_scaling)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [num_tokens, hidden] for int64 ids [num_tokens]."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                attention: AttentionBackend, meta: AttentionMetadata, embed_rows: torch.Tensor | None = None,
                embed_values: torch.Tensor | None = None) -> torch.Tensor:
        """Run every layer over a flat batch.

        Args:
            input_ids: int64 [num_tokens].
            positions: int64 [num_tokens] (RoPE) or [3, num_tokens] (M-RoPE t/h/w).
            cache: the paged KV cache; this step's K/V are written at `meta.slot_mapping`.
            attention: the backend that writes K/V and attends; `meta` is its metadata for this step.
            embed_rows / embed_values: optional int64 [n] flat rows whose embedding lookup is
                replaced by `embed_values` [n, hidden] (projected image rows).
        Returns:
            the residual stream after the last layer [num_tokens, hidden]; `compute_logits` applies
            the final norm, to the rows it projects only.
        """
        fused = self.fused_decode
        if (fused is not None and fused.gathers and embed_rows is None and positions.ndim == 1
                and fused.accepts(meta, input_ids.shape[0])):
            return fused.run_ids(input_ids, positions, meta)  # the lookups below in the same C call
        x = self.embed(input_ids)  # [num_tokens, hidden]
        if embed_rows is not None and embed_rows.numel():
            x[embed_rows] = embed_values.to(x.dtype)
        cos, sin = self.rotary.cos_sin(positions, self.rotary_dtype or x.dtype)  # [num_tokens, head_dim]
        if fused is not None and fused.accepts(meta, x.shape[0]):
            return fused(x, cos, sin, meta)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, attention, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Residual rows [rows, hidden] (from `forward`) -> final norm -> float32 logits [rows, vocab]."""
        if self.fused_decode is not None:  # a few rows on a row-major head: the C GEMV
            return self.fused_decode.project(self.lm_head, self.model.norm(hidden)).float()
        return self.lm_head(self.model.norm(hidden)).float()


def load_checkpoint(model_cls: type[LlamaForCausalLM], checkpoint: CheckpointConfig, dtype: torch.dtype,
                    mrope_section: tuple[int, int, int] | None = None, quant_mode: str = "exact") -> LlamaForCausalLM:
    """Build `model_cls` from the checkpoint's config.json and load its safetensors weights by name;
    matrices its header names as GGUF blocks stay quantized (quantized_model.py), multiplied in
    `quant_mode` ("exact" or "fast", quant.QUANT_MODES).

    Raises:
        ValueError: unsupported configuration, missing weights or unexpected weight names/shapes.
    """
    spec = model_cls.spec_from_config(dict(checkpoint.raw))
    return build_model(model_cls, spec, mrope_section, _read_safetensors(checkpoint.model_dir), dtype,
                       f"weights in {checkpoint.model_dir} do not match {spec.architecture}",
                       quantized_types(checkpoint.model_dir), quant_mode)


def build_model(model_cls: type[LlamaForCausalLM], spec: LlamaSpec, mrope_section: tuple[int, int, int] | None,
                state: dict[str, torch.Tensor], dtype: torch.dtype, mismatch: str,
                quantized: dict[str, str] | None = None, quant_mode: str = "exact") -> LlamaForCausalLM:
    """Assign `state` (HF names) to a new model without a second copy; ties lm_head when the spec
    does and `state` holds no lm_head.weight that differs from the embeddings (`_ties_head`).
    `quantized`: HF name -> GGML type of the tensors `state` holds as GGUF blocks (kept quantized,
    quantized_model.py; a family that rewrites its weights in `convert_checkpoint` gets them
    dequantized).

    Raises:
        ValueError: `mismatch` followed by the first weight whose shape config.json's sizes do not
            give, or by the first missing and unexpected weight names.
    """
    with torch.device("meta"):
        model = model_cls(spec, mrope_section)
    shapes = checkpoint_shapes(model)
    blocks = split_quantized(state, quantized or {}, shapes, mismatch)
    linears = {module_name: [f"{name}.weight" for name in _part_names(module_name, module)]
               for module_name, module in model.named_modules() if isinstance(module, Linear)}
    served = {"model.embed_tokens.weight"} | {part for parts in linears.values() for part in parts
                                              if all(p in blocks for p in parts)}
    dense = {name: blocks.pop(name) for name in list(blocks) if name not in served}
    if dense:  # e.g. MoE experts, stacked at load (convert_checkpoint), or a fused part beside a dense one
        log.info("%d GGUF-quantized tensors are served dequantized (no projection takes them as blocks): %s",
                 len(dense), ", ".join(sorted(dense)[:3]))
        dequantize_into(state, dense, shapes)
    model_cls.convert_checkpoint(spec, state)
    tied = _ties_head(spec, state) if "model.embed_tokens.weight" not in blocks else \
        spec.tie_word_embeddings and "lm_head.weight" not in state and "lm_head.weight" not in blocks
    if tied:
        state.pop("lm_head.weight", None)
    for name, tensor in state.items():
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{mismatch}: {name} has shape {list(tensor.shape)}; config.json's sizes need "
                             f"{list(shapes[name])}")
    fuse_projections(state, spec.num_layers)
    expected = {k for k in model.state_dict() if not (tied and k == "lm_head.weight")}
    expected -= {f"{module_name}.weight" for module_name, parts in linears.items() if parts[0] in blocks}
    expected -= {"model.embed_tokens.weight"} & blocks.keys()
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(f"{mismatch}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    release_file_pages(v for v in state.values() if v.dtype != dtype)  # converted: the file's copy is dropped
    if tied and "model.embed_tokens.weight" not in blocks:
        model.lm_head.weight = model.model.embed_tokens.weight
    if blocks:  # after the dense tie: a tied head of quantized embeddings takes their blocks here
        attach_quantized(model, blocks, quant_mode, tied)
    return model.eval()


def _part_names(module_name: str, module: nn.Module) -> list[str]:
    """The checkpoint projections a Linear computes: its LoRA slices' names, else its own."""
    return [name for name, _, _ in getattr(module, "lora_slices", None) or ()] or [module_name]


def _ties_head(spec: LlamaSpec, state: dict[str, torch.Tensor]) -> bool:
    """Whether lm_head is the embeddings: config.json ties them and the file's lm_head.weight is
    absent or equal to them. A different one is kept, as transformers 5 does (it warns that both
    are present with different values and does not tie them)."""
    if not spec.tie_word_embeddings:
        return False
    head, embeddings = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if head is None or embeddings is None or head.shape != embeddings.shape or torch.equal(head, embeddings):
        return True
    log.info("lm_head.weight differs from the embeddings although config.json ties them: keeping the "
             "checkpoint's own lm_head, as transformers does")
    return False


def checkpoint_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shape of every weight a checkpoint holds for `model` (HF names: the q/k/v and gate/up
    parts, not the fused modules they are concatenated into), from its parameters (a meta model will do)."""
    shapes = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    for module in model.modules():
        for name, start, end in getattr(module, "lora_slices", None) or ():
            shapes[f"{name}.weight"] = (end - start, module.in_features)
            if module.bias is not None:
                shapes[f"{name}.bias"] = (end - start,)
    return shapes


def quantized_types(model_dir: Path) -> dict[str, str]:
    """HF name -> GGML type of the tensors the checkpoint's safetensors hold as GGUF blocks (their
    headers' QUANTIZATION_METADATA; {} for a dense checkpoint). Raises ValueError naming the file
    when that entry is not a JSON object of names to type names."""
    from safetensors import safe_open

    types: dict[str, str] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                text = (handle.metadata() or {}).get(QUANTIZATION_METADATA)
        except SafetensorError:
            continue  # _read_safetensors names the damaged file
        if text is None:
            continue
        try:
            entries = json.loads(text)
            if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
                raise ValueError("not an object of tensor names to GGML type names")
        except ValueError as error:
            raise ValueError(f"{path}: its header's {QUANTIZATION_METADATA} entry is unreadable: {error}") from None
        types.update(entries)
    return types


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (HF names). Raises ValueError naming the file when there is no
    weights file or one is not readable safetensors (truncated, corrupt); OSError for a missing shard."""
    single = model_dir / "model.safetensors"
    if single.is_file():
        return _load_weights(single)
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        raise ValueError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map of tensor name -> "
                         f"file): {error!r}") from None
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        path = model_dir / str(shard)
        if path.resolve().parent != model_dir.resolve():  # a shard is a file of the checkpoint directory itself
            raise ValueError(f"{index} names shard {shard!r}, which is not a file in {model_dir}")
        state.update(_load_weights(path))
    return state


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except SafetensorError as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error}): the checkpoint's weights "
                         "are damaged or incomplete") from None
