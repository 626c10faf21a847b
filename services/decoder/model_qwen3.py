"""Qwen3: the Llama block with a per-head RMSNorm of q and k before RoPE.

As transformers' Qwen3Attention: `q_norm`/`k_norm` are RMSNorm(head_dim) applied to each head of
the projected q and k, then rotary; `head_dim` comes from config.json (default 128, as
Qwen3Config; not hidden / heads); q/k/v/o biases follow `attention_bias`, the MLP has none;
sliding-window layers as Qwen2 (`qwen_layer_windows`). Everything else is model_llama.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.decoder.model_llama import LlamaAttention, LlamaForCausalLM, LlamaSpec, RMSNorm
from services.decoder.model_qwen2 import QwenSpec, set_layer_windows


class Qwen3Attention(LlamaAttention):
    def __init__(self, spec: LlamaSpec, layer: int) -> None:
        super().__init__(spec, layer)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, head_dim], k [n, kv_heads, head_dim]: RMSNorm over head_dim."""
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

    @classmethod
    def spec_from_config(cls, cfg: dict) -> LlamaSpec:
        architecture = (cfg.get("architectures") or ["Qwen3ForCausalLM"])[0]
        cfg = {"head_dim": 128, **cfg}  # Qwen3Config's default, not hidden_size / heads
        return replace(QwenSpec.from_config(cfg), architecture=architecture, mlp_bias=False)

    def __init__(self, spec: LlamaSpec, mrope_section: tuple[int, int, int] | None = None) -> None:
        super().__init__(spec, mrope_section)
        set_layer_windows(self, spec)
