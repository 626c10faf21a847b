"""Qwen3-MoE (and Qwen2-MoE): the Qwen3 (Qwen2) attention with sparse mixture-of-experts MLPs.

As transformers 5's Qwen3MoeForCausalLM: a layer is sparse unless it is listed in `mlp_only_layers`
or `(layer + 1) % decoder_sparse_step != 0` (those keep a dense MLP of `intermediate_size`); a sparse
layer routes to the top `num_experts_per_tok` of `num_experts` experts of `moe_intermediate_size`,
renormalized only with `norm_topk_prob`, the routing weights cast to the activations' dtype (moe.py).
`head_dim` defaults to hidden_size / heads (Qwen3MoeConfig has no 128 default, unlike Qwen3).
Qwen2MoeForCausalLM adds the q/k/v biases of `qkv_bias` and a shared expert of
`shared_expert_intermediate_size` behind a sigmoid gate. Per-expert `mlp.experts.{e}.gate_proj/up_proj/
down_proj` (what save_pretrained writes) or the stacked `mlp.experts.gate_up_proj/down_proj` load by name.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.decoder.model_llama import LlamaForCausalLM, LlamaSpec
from services.decoder.model_qwen3 import Qwen3Attention
from services.decoder.moe import MoeDecoderLayer, MoeSpec, convert_moe_checkpoint, moe_spec


def _qwen_moe_spec(cfg: dict, base: LlamaSpec) -> MoeSpec:
    return moe_spec(base, cfg, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), round_routing_weights=True)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
    layer_cls = MoeDecoderLayer

    @classmethod
    def spec_from_config(cls, cfg: dict) -> MoeSpec:
        base = replace(LlamaSpec.from_config(cfg), architecture=(cfg.get("architectures") or ["Qwen3MoeForCausalLM"])[0],
                       mlp_bias=False)
        return _qwen_moe_spec(cfg, base)

    @classmethod
    def convert_checkpoint(cls, spec: MoeSpec, state: dict[str, torch.Tensor]) -> None:
        convert_moe_checkpoint(spec, state)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    attention_cls = LlamaForCausalLM.attention_cls

    @classmethod
    def spec_from_config(cls, cfg: dict) -> MoeSpec:
        bias = bool(cfg.get("qkv_bias", True))
        base = replace(LlamaSpec.from_config(cfg), architecture=(cfg.get("architectures") or ["Qwen2MoeForCausalLM"])[0],
                       qkv_bias=bias, o_bias=False, mlp_bias=False)
        return _qwen_moe_spec(cfg, base)
