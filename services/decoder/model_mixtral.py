"""Mixtral: the Llama attention with a sparse mixture-of-experts MLP in every layer.

As transformers 5's MixtralForCausalLM: `num_local_experts` experts of `intermediate_size`, top
`num_experts_per_tok` of a float32 softmax, always renormalized to sum to 1, and the weights kept in
float32 for the weighted sum (moe.py); no biases. The checkpoint's `block_sparse_moe.experts.{e}.w1/w3/w2`
(what save_pretrained writes) or transformers 5's stacked `mlp.experts.gate_up_proj/down_proj` load
by name. A `sliding_window` is refused.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.decoder.model_llama import LlamaForCausalLM, LlamaSpec
from services.decoder.moe import MoeDecoderLayer, MoeSpec, convert_moe_checkpoint, moe_spec


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MoeDecoderLayer

    @classmethod
    def spec_from_config(cls, cfg: dict) -> MoeSpec:
        if cfg.get("sliding_window") is not None:
            raise ValueError(f"Mixtral's sliding_window {cfg['sliding_window']!r} is not supported; expected null")
        base = replace(LlamaSpec.from_config(cfg), architecture=(cfg.get("architectures") or ["MixtralForCausalLM"])[0],
                       qkv_bias=False, o_bias=False, mlp_bias=False)
        return moe_spec(base, cfg, num_experts_key=("num_local_experts",), norm_topk_prob=True,
                        round_routing_weights=False, moe_intermediate_size=base.intermediate_size, sparse_step=False)

    @classmethod
    def convert_checkpoint(cls, spec: MoeSpec, state: dict[str, torch.Tensor]) -> None:
        convert_moe_checkpoint(spec, state)
