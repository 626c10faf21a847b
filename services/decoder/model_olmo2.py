"""OLMo 2: the Llama block with q/k RMSNorm over the whole projection and post-norms only.

As transformers' Olmo2ForCausalLM (modeling_olmo2.py):
- `q_norm` / `k_norm` are RMSNorm(heads * head_dim) / RMSNorm(kv_heads * head_dim) over the whole
  q and k projections, before the split into heads and RoPE (Qwen3 normalizes each head instead);
- a layer has no pre-norms: `x + post_attention_layernorm(attn(x))`, then
  `x + post_feedforward_layernorm(mlp(x))`; the final norm is as Llama's;
- Olmo2RMSNorm scales in float32 and rounds once (`(w * x_f32).to(dtype)`; Llama rounds x first);
- cos/sin stay float32 and the rotation is computed in float32, then rounded to q's dtype.
In float32 all of these equal Llama's ops, so the C RMSNorm and rotary kernels run there; in
bfloat16 torch's ops run in transformers' order. The MLP has no bias; q/k/v/o biases follow
`attention_bias`; rms_norm_eps defaults to 1e-5 (Olmo2Config).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from services.decoder.model_llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaSpec, RMSNorm
from services.decoder.rotary import apply_rotary

DEFAULTS = {"rms_norm_eps": 1e-5}  # Olmo2Config's, where Llama's reading would take 1e-6


class Olmo2RMSNorm(RMSNorm):
    """transformers' Olmo2RMSNorm: normalize in float32, scale in float32, round once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same values as Llama's RMSNorm (and its C kernel)
            return super().forward(x)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, spec: LlamaSpec, layer: int) -> None:
        super().__init__(spec, layer)
        self.q_norm = Olmo2RMSNorm(spec.num_heads * spec.head_dim, spec.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(spec.num_kv_heads * spec.head_dim, spec.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, head_dim], k [n, kv_heads, head_dim]: RMSNorm over all heads of a row at once."""
        n = q.shape[0]
        return self.q_norm(q.reshape(n, -1)).view(q.shape), self.k_norm(k.reshape(n, -1)).view(k.shape)

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin float32 [n, head_dim]: in float32 Llama's rotation; else computed in float32
        (q * cos promotes) and rounded to q's and k's dtype, as transformers' OLMo 2."""
        if cos.dtype == q.dtype:
            return super().rotate_qk(q, k, cos, sin)
        return apply_rotary(q, cos, sin).to(q.dtype), apply_rotary(k, cos, sin).to(k.dtype)


class Olmo2DecoderLayer(nn.Module):
    """Attention and MLP, each output normalized before the residual add (no input norms)."""

    def __init__(self, spec: LlamaSpec, layer: int, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        self.self_attn = attention_cls(spec, layer)
        self.mlp = LlamaMLP(spec, layer)
        self.post_attention_layernorm = Olmo2RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, cos, sin, cache, attention, meta):
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, cache, attention, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(LlamaForCausalLM):
    attention_cls = Olmo2Attention
    layer_cls = Olmo2DecoderLayer
    rotary_dtype = torch.float32

    @classmethod
    def spec_from_config(cls, cfg: dict) -> LlamaSpec:
        architecture = (cfg.get("architectures") or ["Olmo2ForCausalLM"])[0]
        return replace(LlamaSpec.from_config({**DEFAULTS, **cfg}), architecture=architecture, mlp_bias=False)

    def __init__(self, spec: LlamaSpec, mrope_section: tuple[int, int, int] | None = None) -> None:
        super().__init__(spec, mrope_section)
        self.model.norm = Olmo2RMSNorm(spec.hidden_size, spec.rms_norm_eps)
