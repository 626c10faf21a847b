"""Granite 3: the Llama block with embedding, attention (softmax scale) and residual multipliers, and
logits divided by `logits_scaling`.

As transformers' GraniteForCausalLM (modeling_granite.py), each a float that defaults to 1.0:
`embedding_multiplier` scales the token embeddings; `attention_multiplier` is the softmax scale
(in place of head_dim ** -0.5); `residual_multiplier` scales each attention and MLP output before
it is added to the residual stream; the logits are divided by `logits_scaling`. Each product is
taken in the activations' dtype, in transformers' order. Everything else (q/k/v/o biases from
`attention_bias`, `mlp_bias`, RMSNorm, SiLU) is model_llama.py, the C pointwise kernels included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.decoder.model_llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaSpec

MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


@dataclass(frozen=True)
class GraniteSpec(LlamaSpec):
    """LlamaSpec and Granite's multipliers (GraniteConfig's fields, 1.0 when absent)."""

    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


class GraniteAttention(LlamaAttention):
    def __init__(self, spec: GraniteSpec, layer: int) -> None:
        super().__init__(spec, layer)
        self.scale = spec.attention_multiplier  # softmax(q k^T * attention_multiplier)


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, spec: GraniteSpec, layer: int, attention_cls: type[LlamaAttention]) -> None:
        super().__init__(spec, layer, attention_cls)
        self.residual_multiplier = spec.residual_multiplier

    def forward(self, x, cos, sin, cache, attention, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, attention, meta) * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    attention_cls = GraniteAttention
    layer_cls = GraniteDecoderLayer

    @classmethod
    def spec_from_config(cls, cfg: dict) -> GraniteSpec:
        """Raises ValueError for a multiplier that is not a finite number (logits_scaling: nonzero),
        or what LlamaSpec refuses."""
        base = LlamaSpec.from_config(cfg)
        values = {"architecture": (cfg.get("architectures") or ["GraniteForCausalLM"])[0]}
        for name in MULTIPLIERS:
            value = cfg.get(name, 1.0)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or (name == "logits_scaling" and value == 0):
                raise ValueError(f"config.json's {name} must be a finite number"
                                 f"{' other than 0' if name == 'logits_scaling' else ''}, got {value!r}")
            values[name] = float(value)
        return base.extended(GraniteSpec, **values)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times embedding_multiplier [num_tokens, hidden] for int64 ids [num_tokens]."""
        return super().embed(input_ids) * self.spec.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Residual rows [rows, hidden] -> final norm -> lm_head / logits_scaling (in the model's
        dtype, as transformers) -> float32 logits [rows, vocab]."""
        return (self.lm_head(self.model.norm(hidden)) / self.spec.logits_scaling).float()
