"""RMSNorm and rotary embedding in the C kernels (kernels/norm_rope.c), for the cpu linear backend.

`CpuPointwise` replaces two chains of torch elementwise ops per layer: `rms_norm` equals
transformers' LlamaRMSNorm up to the order of the sum of squares, `rotary` equals
`x * cos + rotate_half(x) * sin` (tessera/decoder/rotary.py) bit for bit, in float32 and bfloat16.
`attach_pointwise` hands one to every RMSNorm and attention module of a model.
"""

from __future__ import annotations

import torch
from torch import nn

_DTYPES = (torch.float32, torch.bfloat16)


class CpuPointwise:
    """The C RMSNorm and rotary kernels.

    Raises (constructor): RuntimeError as `native.load` (no C compiler with OpenMP).
    """

    def __init__(self) -> None:
        from tessera.decoder.kernels import native

        library = native.load()
        self._rms_norm = {torch.float32: library.tessera_rms_norm_f32, torch.bfloat16: library.tessera_rms_norm_bf16}
        self._rotary = {torch.float32: library.tessera_rotary_f32, torch.bfloat16: library.tessera_rotary_bf16}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., hidden], weight [hidden], both float32 or both bfloat16 on the CPU -> a new
        contiguous tensor of x's shape and dtype (statistics in float32; see norm_rope.c).

        Raises:
            ValueError: another dtype or device, mixed dtypes, a 0-dim x, or a weight that is not [hidden].
        """
        if x.dim() == 0:
            raise ValueError("the C RMSNorm takes x [..., hidden], got a 0-dim tensor")
        hidden = x.shape[-1]
        if x.dtype not in _DTYPES or weight.dtype != x.dtype or x.device.type != "cpu" or weight.device.type != "cpu":
            raise ValueError(f"the C RMSNorm takes float32 or bfloat16 x and weight of one dtype on the CPU, got "
                             f"{x.dtype} on {x.device} and {weight.dtype} on {weight.device}")
        if weight.shape != (hidden,):
            raise ValueError(f"RMSNorm weight must be [{hidden}], got {tuple(weight.shape)}")
        x, weight = x.contiguous(), weight.contiguous()
        y = torch.empty_like(x)
        if x.numel():
            self._rms_norm[x.dtype](x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // hidden, hidden, eps,
                                    torch.get_num_threads())
        return y

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [tokens, heads, head_dim] by cos/sin [tokens, head_dim] (x's dtype): a new
        contiguous tensor, the bits of `rotary.apply_rotary`. x may be a column view (each head's
        values contiguous, heads adjacent, any row stride), as q and k of the fused projection are.

        Raises:
            ValueError: another dtype or device, mixed dtypes, an odd head_dim, or shapes that do not fit.
        """
        if x.dim() != 3 or cos.shape != (x.shape[0], x.shape[2]) or sin.shape != cos.shape or x.shape[2] % 2:
            raise ValueError(f"rotary takes x [tokens, heads, head_dim] (head_dim even) and cos/sin "
                             f"[tokens, head_dim], got {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
        tensors = (x, cos, sin)
        if x.dtype not in _DTYPES or any(t.dtype != x.dtype or t.device.type != "cpu" for t in tensors):
            raise ValueError("the C rotary takes float32 or bfloat16 x, cos and sin of one dtype on the CPU, got "
                             + ", ".join(f"{t.dtype} on {t.device}" for t in tensors))
        tokens, heads, head_dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != head_dim or (tokens > 1 and x.stride(0) < heads * head_dim):
            x = x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        y = torch.empty(x.shape, dtype=x.dtype)
        if x.numel():
            self._rotary[x.dtype](x.data_ptr(), x.stride(0), y.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens,
                                  heads, head_dim, torch.get_num_threads())
        return y


def attach_pointwise(model: nn.Module, pointwise: CpuPointwise | None) -> None:
    """Give every module of `model` with a `pointwise` attribute (RMSNorm, the attention modules)
    `pointwise`: their forward then runs the C kernels; None: torch's ops."""
    for module in model.modules():
        if hasattr(module, "pointwise"):
            module.pointwise = pointwise
