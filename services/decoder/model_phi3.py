"""Phi-3, Phi-3.5 and Phi-4-mini (transformers' Phi3ForCausalLM): the Llama block with the
checkpoint's own fused projections, a partial rotary factor, longrope and a sliding window.

As transformers' modeling_phi3.py:
- the checkpoint holds `qkv_proj` (q, then k, then v rows) and `gate_up_proj` (gate, then up rows)
  already fused, so each loads as it is, one LoRA slice each: LoRA targets `qkv_proj`, `o_proj`,
  `gate_up_proj` and `down_proj`, the names PEFT sees on Phi-3; no biases, SiLU;
- `partial_rotary_factor` (Phi-4-mini: 0.75): RoPE rotates the first
  rotary_dim = int(head_dim * factor) dims of each head and passes the rest through
  (`apply_rotary_pos_emb`); the frequencies are those of a rotary_dim head;
- longrope (`rope_type` "longrope", or the legacy "su" / "yarn" that Phi3Config reads as it):
  short and long factors, chosen per request as transformers' generate does (rotary.LongRope), with
  the attention factor on cos and sin;
- `sliding_window` (config.json; None: full attention) masks every layer, as Phi3Attention passes it;
- head_dim is config.json's `head_dim` if present, else hidden_size / num_attention_heads.
Everything else is model_llama.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import Phi3Config

from services.common.checkpoint import check_rope_type
from services.decoder.model_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaSpec,
    _linear,
    positive_or_none,
)
from services.decoder.rotary import RopeScaling, RotaryEmbedding

# what Phi3Config's validation accepts (after reading the legacy "su" and "yarn" as longrope)
PHI3_ROPE_TYPES = ("default", "longrope")


@dataclass(frozen=True)
class Phi3Spec(LlamaSpec):
    """LlamaSpec plus the dims RoPE rotates and the attention window."""

    rotary_dim: int = 0  # int(head_dim * partial_rotary_factor)
    sliding_window: int | None = None  # keys within this many positions of the query; None: all

    @classmethod
    def from_config(cls, cfg: dict) -> Phi3Spec:
        """Phi-3's reading of config.json: rope parameters as transformers' Phi3Config standardizes
        them (legacy `rope_scaling`, top-level `rope_theta`, `partial_rotary_factor` and
        `original_max_position_embeddings`).

        Raises:
            ValueError: a config Phi3Config rejects (bad longrope factors, ...), a rope type other than
                default or longrope, a partial rotary factor that does not rotate an even number of
                dims, or what LlamaSpec refuses (another activation).
        """
        try:
            config = Phi3Config.from_dict(dict(cfg))
        except (TypeError, ValueError, KeyError) as error:
            raise ValueError(f"config.json is not a Phi-3 config transformers accepts: {error}") from None
        rope = config.rope_parameters
        rope_type = rope["rope_type"]
        check_rope_type(rope_type, PHI3_ROPE_TYPES)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        factor = rope.get("partial_rotary_factor", 1.0)
        rotary_dim = int(head_dim * factor)
        if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"partial_rotary_factor {factor!r} rotates {rotary_dim} of head_dim {head_dim} dims; "
                             "an even number from 2 to head_dim is needed")
        # LlamaSpec reads the rest; the rope fields are Phi-3's, read above
        plain = {key: value for key, value in cfg.items()
                 if key not in ("rope_scaling", "rope_parameters", "partial_rotary_factor")}
        plain.update(rope_theta=rope["rope_theta"], head_dim=head_dim, attention_bias=False, mlp_bias=False)
        spec = LlamaSpec.from_config(plain)
        scaling = RopeScaling.from_config(dict(cfg), rope_type) if rope_type == "longrope" else None
        return spec.extended(cls, architecture=(cfg.get("architectures") or ["Phi3ForCausalLM"])[0],
                             rope_scaling=scaling, rotary_dim=rotary_dim,
                             sliding_window=positive_or_none("sliding_window", config.sliding_window, integer=True))


class Phi3Attention(LlamaAttention):
    def __init__(self, spec: Phi3Spec, layer: int) -> None:
        super().__init__(spec, layer)
        prefix = f"model.layers.{layer}.self_attn"
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.qkv_proj = _linear(prefix, spec.hidden_size, (("qkv_proj", (h + 2 * kv) * d),), False)
        self.rotary_dim = spec.rotary_dim
        self.sliding_window = spec.sliding_window

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, head_dim], k [n, kv_heads, head_dim], cos/sin [n, rotary_dim]: the first
        rotary_dim dims of each head rotated, the rest passed through (transformers' Phi-3)."""
        if self.rotary_dim == self.head_dim:
            return super().rotate_qk(q, k, cos, sin)
        r = self.rotary_dim
        q_rot, k_rot = super().rotate_qk(q[..., :r], k[..., :r], cos, sin)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


class Phi3MLP(LlamaMLP):
    def __init__(self, spec: Phi3Spec, layer: int) -> None:
        super().__init__(spec, layer)
        inter = spec.intermediate_size
        self.gate_up_proj = _linear(f"model.layers.{layer}.mlp", spec.hidden_size, (("gate_up_proj", 2 * inter),),
                                    False)


class Phi3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, spec: Phi3Spec, layer: int, attention_cls: type[LlamaAttention] = Phi3Attention) -> None:
        super().__init__(spec, layer, attention_cls)
        self.mlp = Phi3MLP(spec, layer)


class Phi3ForCausalLM(LlamaForCausalLM):
    attention_cls = Phi3Attention
    layer_cls = Phi3DecoderLayer

    @classmethod
    def spec_from_config(cls, cfg: dict) -> Phi3Spec:
        return Phi3Spec.from_config(cfg)

    def __init__(self, spec: Phi3Spec, mrope_section: tuple[int, int, int] | None = None) -> None:
        if mrope_section is not None:
            raise ValueError("Phi-3 has no M-RoPE sections")
        super().__init__(replace(spec, rope_scaling=None))  # the base's table rotates whole heads
        self.spec = spec
        self.rotary = RotaryEmbedding(spec.rotary_dim, spec.rope_theta, None, spec.rope_scaling)
