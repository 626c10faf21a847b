"""Gemma, Gemma 2 and Gemma 3 text: the Llama block with (1 + w) RMSNorms, a tanh-GELU gated MLP and
embeddings scaled by sqrt(hidden); Gemma 2 and 3 add post-sublayer norms, local (sliding-window)
and global layers, `query_pre_attn_scalar` and final logit soft-capping (Gemma 2 also on attention
scores), Gemma 3 q/k norms and a RoPE base per layer type.

The math of transformers 5's modeling_gemma.py, modeling_gemma2.py and modeling_gemma3.py
(Gemma3ForCausalLM), dtype order included:

- embeddings times sqrt(hidden_size), a normalizer rounded to the model dtype (as transformers'
  GemmaTextScaledWordEmbedding);
- RMSNorm with a (1 + weight) scale, normalized and scaled in float32, then cast (`GemmaRMSNorm`;
  Llama casts before it scales);
- GeGLU MLP: gelu(gate, tanh approximation) * up (`hidden_act` in Gemma, `hidden_activation` in
  Gemma 2 and 3);
- Gemma 2 and 3: attention scale `query_pre_attn_scalar ** -0.5`; an RMSNorm after attention and
  around the MLP (`post_attention_layernorm`, `pre_feedforward_layernorm`,
  `post_feedforward_layernorm`); `layer_types` alternating "sliding_attention" (a window of
  `sliding_window` keys) and "full_attention"; final logits soft-capped as
  cap * tanh(logits / cap) (`final_logit_softcapping`);
- Gemma 2: attention scores soft-capped (`attn_logit_softcapping`). Gemma 3 has the field, but its
  transformers attention does not pass it on, so it is not applied here either;
- Gemma 3: q/k RMSNorm per head before RoPE, and RoPE per layer type (`rope_parameters`
  {"full_attention": ..., "sliding_attention": ...}: the local layers' own base, legacy
  `rope_local_base_freq`; the global layers' scaling, e.g. linear), each from transformers'
  `ROPE_INIT_FUNCTIONS`.

The family is LlamaForCausalLM through its hooks (`attention_cls`, `layer_cls`, `normalize_qk`),
with Gemma's final norm, embedding scale, logits cap and one RoPE table per layer type
(`LayerTypeRotary`). A sliding layer's window reaches the attention backend through
`LlamaAttention.sliding_window`; a model with a global layer releases no KV block early
(models.py `model_sliding_window`).

config.json is read through transformers' own config class for its model_type, so absent fields
take transformers' defaults (Gemma 2's soft caps 50 and 30, `query_pre_attn_scalar` 256, layer
types from `sliding_window_pattern`). Projections are fused as model_llama.py fuses them (LoRA still
targets the checkpoint's q/k/v/o and gate/up/down names); the C RMSNorm and SiLU gate of
kernels/pointwise.py never run here (Gemma's norm and gate differ), the C rotary does (the same math).
Bidirectional attention, longrope and a partial rotary factor are refused in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from services.common.checkpoint import check_rope_type
from services.decoder.attention import AttentionBackend, AttentionMetadata
from services.decoder.kv_cache import KVCache
from services.decoder.model_llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaSpec, positive_or_none
from services.decoder.rotary import RopeScaling, RotaryEmbedding

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclass(frozen=True)
class GemmaSpec(LlamaSpec):
    """LlamaSpec plus Gemma's facts. `rope_theta` / `rope_scaling` are the full-attention layers' RoPE.

    Attributes:
        query_pre_attn_scalar: attention scale is its ** -0.5 (Gemma 2, 3); None: head_dim ** -0.5.
        attn_logit_softcapping: attention scores capped at +-cap (Gemma 2); None: not capped.
        final_logit_softcapping: logits capped at +-cap (Gemma 2, 3); None: not capped.
        sliding_window: keys a sliding layer's query sees, itself included; None: every key.
        layer_types: SLIDING or FULL per layer.
        sandwich_norms: Gemma 2/3's post-attention and pre/post feed-forward norms.
        qk_norm: Gemma 3's per-head q/k RMSNorm.
        local_rope_theta / local_rope_scaling: the sliding layers' RoPE.
    """

    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    sandwich_norms: bool = False
    qk_norm: bool = False
    local_rope_theta: float = 10000.0
    local_rope_scaling: RopeScaling | None = None

    @classmethod
    def from_config(cls, cfg: dict) -> GemmaSpec:
        """Gemma's reading of config.json (model_type "gemma", "gemma2" or "gemma3_text"), through
        transformers' config class for it.

        Raises:
            ValueError: a field transformers' config rejects, an activation other than tanh GELU,
                bidirectional attention, an unknown layer type, a RoPE type that is not served
                (longrope), a partial rotary factor; each in one line naming the field.
        """
        model_type = cfg.get("model_type")
        try:
            config = CONFIG_MAPPING[model_type].from_dict(dict(cfg))
        except (StrictDataclassError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"config.json is not a {model_type} config transformers reads: "
                             f"{str(error).splitlines()[0]}") from None
        gemma1 = model_type == "gemma"
        activation = config.hidden_act if gemma1 else config.hidden_activation
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"{'hidden_act' if gemma1 else 'hidden_activation'} {activation!r} is not supported; "
                             "expected 'gelu_pytorch_tanh'")
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention is not supported: the decoder serves causal attention")
        layer_types = tuple(getattr(config, "layer_types", None) or (FULL,) * config.num_hidden_layers)
        if set(layer_types) - {SLIDING, FULL} or len(layer_types) != config.num_hidden_layers:
            raise ValueError(f"layer_types {list(layer_types)} is not supported: one of {SLIDING!r} or {FULL!r} "
                             f"per layer ({config.num_hidden_layers})")
        if not gemma1 and SLIDING in layer_types and config.sliding_window is None:
            raise ValueError(f"config.json's sliding_window is null but layer_types has {SLIDING!r} layers (a "
                             f"{model_type} model transformers cannot build); give the window, a positive integer")
        if model_type == "gemma3_text":
            (theta, scaling), (local_theta, local_scaling) = (_rope(config, FULL), _rope(config, SLIDING))
        else:
            theta, scaling = _rope(config, None)
            local_theta, local_scaling = theta, scaling
        bias = bool(config.attention_bias)
        return cls(
            architecture=(cfg.get("architectures") or [_ARCHITECTURES[model_type]])[0],
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=theta,
            tie_word_embeddings=bool(config.tie_word_embeddings), qkv_bias=bias, o_bias=bias, mlp_bias=False,
            max_position_embeddings=config.max_position_embeddings, rope_scaling=scaling,
            query_pre_attn_scalar=None if gemma1 else positive_or_none("query_pre_attn_scalar",
                                                                       config.query_pre_attn_scalar),
            attn_logit_softcapping=positive_or_none("attn_logit_softcapping", config.attn_logit_softcapping)
            if model_type == "gemma2" else None,
            final_logit_softcapping=None if gemma1 else positive_or_none("final_logit_softcapping",
                                                                         config.final_logit_softcapping),
            sliding_window=None if gemma1 else positive_or_none("sliding_window", config.sliding_window, integer=True),
            layer_types=layer_types,
            sandwich_norms=not gemma1, qk_norm=model_type == "gemma3_text",
            local_rope_theta=local_theta, local_rope_scaling=local_scaling,
        )


_ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def _rope(config: Any, layer_type: str | None) -> tuple[float, RopeScaling | None]:
    """(theta, scaling or None for default RoPE) of `layer_type`'s rope_parameters (the whole
    rope_parameters for None) in transformers' config, scaled frequencies from its ROPE_INIT_FUNCTIONS.
    Raises ValueError naming a refused type or a partial rotary factor."""
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = params.get("rope_type", "default")
    where = f"rope_parameters[{layer_type!r}]" if layer_type else "rope_parameters"
    try:
        check_rope_type(rope_type)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {params['partial_rotary_factor']!r} is not supported: "
                         "Gemma rotates the whole head")
    theta = float(params["rope_theta"])
    if rope_type in ("default", "mrope"):
        return theta, None
    try:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{where}: RoPE scaling {rope_type!r} lacks or mistypes {error}") from None
    return theta, RopeScaling(rope_type, tuple(inv_freq.float().tolist()), float(attention_scaling))


class GemmaRMSNorm(nn.Module):
    """transformers' GemmaRMSNorm: x / rms(x) * (1 + weight), all in float32, then cast to x's dtype.
    The weight is stored as the offset from 1 (zeros is the identity scale)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(LlamaMLP):
    """GeGLU: down(gelu(gate) * up), GELU's tanh approximation as transformers' gelu_pytorch_tanh.
    The inherited `pointwise` (the C SiLU gate) is never used."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, -1)  # [n, inter] column views
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh").mul_(up))


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale, the layer type's window, Gemma 2's score soft-cap and
    Gemma 3's q/k norm (`normalize_qk`)."""

    def __init__(self, spec: GemmaSpec, layer: int) -> None:
        super().__init__(spec, layer)
        if spec.query_pre_attn_scalar is not None:
            self.scale = spec.query_pre_attn_scalar ** -0.5
        self.layer_type = spec.layer_types[layer]
        self.sliding_window = spec.sliding_window if self.layer_type == SLIDING else None
        self.logits_soft_cap = spec.attn_logit_softcapping
        self.qk_norm = spec.qk_norm
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, head_dim], k [n, kv_heads, head_dim]: Gemma 3's RMSNorm over head_dim."""
        if not self.qk_norm:
            return q, k
        return self.q_norm(q), self.k_norm(k)


class GemmaDecoderLayer(nn.Module):
    """Gemma: x + attn(norm(x)), then + mlp(norm(x)). Gemma 2/3 (`sandwich_norms`): each sublayer's
    output is normed again before the residual add (post_attention / post_feedforward), and the
    MLP's input norm is `pre_feedforward_layernorm`."""

    def __init__(self, spec: GemmaSpec, layer: int, attention_cls: type[GemmaAttention] = GemmaAttention) -> None:
        super().__init__()
        self.layer_type = spec.layer_types[layer]
        self.sandwich = spec.sandwich_norms
        self.self_attn = attention_cls(spec, layer)
        self.mlp = GemmaMLP(spec, layer)
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        if self.sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                attention: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, cache, attention, meta)
        if not self.sandwich:
            x = x + attended
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LayerTypeRotary:
    """The RoPE table of each layer type (one shared table where both types use the same RoPE)."""

    def __init__(self, tables: dict[str, RotaryEmbedding]) -> None:
        self.tables = tables

    def to(self, device: torch.device | str) -> LayerTypeRotary:
        """Keep every table on `device` (see RotaryEmbedding.to). Returns self."""
        for table in {id(t): t for t in self.tables.values()}.values():
            table.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Layer type -> (cos, sin), each [num_tokens, head_dim] in `dtype`, for int64 positions [num_tokens]."""
        computed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for table in self.tables.values():
            if id(table) not in computed:
                computed[id(table)] = table.cos_sin(positions, dtype)
        return {layer_type: computed[id(table)] for layer_type, table in self.tables.items()}


class GemmaForCausalLM(LlamaForCausalLM):
    """transformers' GemmaForCausalLM, Gemma2ForCausalLM or Gemma3ForCausalLM (by the spec), with
    LlamaForCausalLM's interface and loading: forward (flat batch -> residual stream) and
    compute_logits (selected rows -> final norm -> soft-capped float32 logits)."""

    attention_cls = GemmaAttention
    layer_cls = GemmaDecoderLayer

    @classmethod
    def spec_from_config(cls, cfg: dict) -> GemmaSpec:
        """The family's reading of config.json. Raises ValueError for what it cannot run."""
        return GemmaSpec.from_config(cfg)

    def __init__(self, spec: GemmaSpec, mrope_section: tuple[int, int, int] | None = None) -> None:
        """Raises ValueError for M-RoPE sections (Gemma's positions are one axis)."""
        if mrope_section is not None:
            raise ValueError(f"mrope_section {mrope_section} is not supported: {spec.architecture} has no M-RoPE")
        super().__init__(spec)
        self.model.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        full = self.rotary  # LlamaForCausalLM's, of rope_theta / rope_scaling: the full-attention layers'
        same = (spec.local_rope_theta, spec.local_rope_scaling) == (spec.rope_theta, spec.rope_scaling)
        local = full if same else RotaryEmbedding(spec.head_dim, spec.local_rope_theta, None, spec.local_rope_scaling)
        self.rotary = LayerTypeRotary({FULL: full, SLIDING: local})
        self.normalizer = math.sqrt(spec.hidden_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times sqrt(hidden_size) [num_tokens, hidden] for int64 ids [num_tokens];
        the normalizer is rounded to the embeddings' dtype first, as transformers does."""
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.normalizer, dtype=x.dtype, device=x.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                attention: AttentionBackend, meta: AttentionMetadata, embed_rows: torch.Tensor | None = None,
                embed_values: torch.Tensor | None = None) -> torch.Tensor:
        """Run every layer over a flat batch: int64 input_ids and positions [num_tokens] -> the
        residual stream after the last layer [num_tokens, hidden] (see LlamaForCausalLM.forward;
        `embed_rows` / `embed_values` replace embedding rows, which are already scaled)."""
        x = self.embed(input_ids)  # [num_tokens, hidden]
        if embed_rows is not None and embed_rows.numel():
            x[embed_rows] = embed_values.to(x.dtype)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)  # layer type -> [num_tokens, head_dim] each
        for layer in self.model.layers:
            x = layer(x, *cos_sin[layer.layer_type], cache, attention, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Residual rows [rows, hidden] -> final norm -> lm_head -> cap * tanh(logits / cap) in the
        model dtype (as transformers, when `final_logit_softcapping` is set) -> float32 [rows, vocab]."""
        logits = self.lm_head(self.model.norm(hidden))
        cap = self.spec.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
