"""Mixtral: the Llama attention, windowed where config.json says so, with a sparse
mixture-of-experts MLP in every layer.

As transformers 5's MixtralForCausalLM: `num_local_experts` experts of `intermediate_size`, top
`num_experts_per_tok` of a float32 softmax, always renormalized to sum to 1, and the weights kept in
float32 for the weighted sum (moe.py); no biases. Every layer attends with config.json's
`sliding_window` (None: full causal attention), a query at position p seeing keys
p - sliding_window < kv <= p, as MixtralAttention passes it to masking_utils. The checkpoint's
`block_sparse_moe.experts.{e}.w1/w3/w2` (what save_pretrained writes) or transformers 5's stacked
`mlp.experts.gate_up_proj/down_proj` load by name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from services.decoder.model_llama import LlamaAttention, LlamaForCausalLM, LlamaSpec, positive_or_none
from services.decoder.moe import MoeDecoderLayer, MoeSpec, convert_moe_checkpoint, moe_spec


@dataclass(frozen=True)
class MixtralSpec(MoeSpec):
    """MoeSpec and the window every layer attends with (None: full causal attention)."""

    sliding_window: int | None = None


class MixtralAttention(LlamaAttention):
    def __init__(self, spec: MixtralSpec, layer: int) -> None:
        super().__init__(spec, layer)
        self.sliding_window = spec.sliding_window


class MixtralForCausalLM(LlamaForCausalLM):
    attention_cls = MixtralAttention
    layer_cls = MoeDecoderLayer

    @classmethod
    def spec_from_config(cls, cfg: dict) -> MixtralSpec:
        """Raises ValueError for what LlamaSpec or MoeSpec refuse, or a `sliding_window` that is not a
        positive integer or null."""
        window = positive_or_none("sliding_window", cfg.get("sliding_window"), integer=True)
        base = replace(LlamaSpec.from_config(cfg), architecture=(cfg.get("architectures") or ["MixtralForCausalLM"])[0],
                       qkv_bias=False, o_bias=False, mlp_bias=False)
        spec = moe_spec(base, cfg, norm_topk_prob=True, round_routing_weights=False)
        return MixtralSpec(**{name: getattr(spec, name) for name in spec.__dataclass_fields__}, sliding_window=window)

    @classmethod
    def convert_checkpoint(cls, spec: MoeSpec, state: dict[str, torch.Tensor]) -> None:
        convert_moe_checkpoint(spec, state)
