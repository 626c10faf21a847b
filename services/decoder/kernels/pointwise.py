"""RMSNorm, rotary embedding and the SiLU gate in the C kernels (kernels/norm_rope.c), for the cpu
linear backend.

`CpuPointwise` replaces three chains of torch elementwise ops per layer: `rms_norm` equals
transformers' LlamaRMSNorm up to the order of the sum of squares, `rotary` equals
`x * cos + rotate_half(x) * sin` (services/decoder/rotary.py) bit for bit, in float32 and bfloat16,
and `silu_mul` is LlamaMLP's `silu(gate) * up` (float32: a few units in the last place from
torch's). `attach_pointwise` hands one to every RMSNorm, attention and MLP module of a model.
"""

from __future__ import annotations

import torch
from torch import nn

_DTYPES = (torch.float32, torch.bfloat16)


class CpuPointwise:
    """The C RMSNorm, rotary and SiLU-gate kernels.

    Raises (constructor): RuntimeError as `native.load` (no C compiler with OpenMP).
    """

    def __init__(self) -> None:
        from services.decoder.kernels import native

        library = native.load()
        self._rms_norm = {torch.float32: library.tessera_rms_norm_f32, torch.bfloat16: library.tessera_rms_norm_bf16}
        self._rotary = {torch.float32: library.tessera_rotary_f32, torch.bfloat16: library.tessera_rotary_bf16}
        self._silu_mul = {torch.float32: library.tessera_silu_mul_f32, torch.bfloat16: library.tessera_silu_mul_bf16}

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

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's gate: gate_up [rows, 2 * inter] (the fused gate/up projection's output: gate
        columns, then up; float32 or bfloat16 on the CPU, any row stride) -> silu(gate) * up, a new
        contiguous [rows, inter] of its dtype (torch's formula and rounding; see norm_rope.c).

        Raises:
            ValueError: another dtype or device, not 2-D, or an odd number of columns.
        """
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"silu_mul takes gate_up [rows, 2 * intermediate], got {tuple(gate_up.shape)}")
        if gate_up.dtype not in _DTYPES or gate_up.device.type != "cpu":
            raise ValueError(f"the C SiLU gate takes float32 or bfloat16 on the CPU, got {gate_up.dtype} "
                             f"on {gate_up.device}")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        if gate_up.stride(1) != 1 or (rows > 1 and gate_up.stride(0) < 2 * inter):
            gate_up = gate_up.contiguous()
        y = torch.empty(rows, inter, dtype=gate_up.dtype)
        if y.numel():
            self._silu_mul[gate_up.dtype](gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), rows, inter,
                                          torch.get_num_threads())
        return y


def attach_pointwise(model: nn.Module, pointwise: CpuPointwise | None) -> None:
    """Give every module of `model` with a `pointwise` attribute (RMSNorm, the attention and MLP
    modules) `pointwise`: their forward then runs the C kernels; None: torch's ops."""
    for module in model.modules():
        if hasattr(module, "pointwise"):
            module.pointwise = pointwise
