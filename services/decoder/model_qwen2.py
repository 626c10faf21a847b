"""Qwen2: the Llama block with biases on the q/k/v projections and none on o_proj.

As transformers' Qwen2Attention (`bias=True` on q_proj, k_proj, v_proj; `bias=False` on o_proj;
the config has no `attention_bias` field; the MLP has no bias). Everything else is model_llama.py.
"""

from __future__ import annotations

from dataclasses import replace

from services.decoder.model_llama import LlamaForCausalLM, LlamaSpec


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: dict) -> LlamaSpec:
        spec = LlamaSpec.from_config(cfg)
        architecture = (cfg.get("architectures") or ["Qwen2ForCausalLM"])[0]
        return replace(spec, architecture=architecture, qkv_bias=True, o_bias=False, mlp_bias=False)
