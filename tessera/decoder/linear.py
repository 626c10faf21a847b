"""Dense projections `x @ W.T (+ b)` of a flat batch of rows, in the GEMM orientation MKL runs faster.

`F.linear` on CPU asks MKL for C[rows, out] = x[rows, in] @ W.T. For decode batches (a few to a
few dozen rows against weights that do not fit in cache) MKL computes the transposed product
C.T[out, rows] = W @ x.T faster, even with the copy back to row-major. Measured on the 2-core
AVX-512 CI machine, torch 2.13, float32, SmolLM2-135M shapes, best of 4, ms:

    rows                                1     2     4     6     8     12    16    24    32    64
    30 layers of projections, F.linear  35.0  51.5  47.8  60.2  50.5  59.7  60.8  74.6  90.9  132
    the same, W @ x.T + copy            35.0  15.3  24.0  35.2  38.7  59.7  50.0  70.6  77.3  114
    lm_head 576 -> 49152, F.linear       9.4  20.9  16.8  22.7  17.3  19.2  19.2  21.6  25.8  37.1
    lm_head, W @ x.T + copy              9.4   3.3   5.3   7.5   8.6  18.0  14.3  21.2  23.5  31.5

Between runs 2-4 and 16-32 rows always favoured W @ x.T; 6-12 rows went either way by up to 20%
(about even on average); past 64 rows F.linear was as fast or faster. So decode steps of up to
32 rows (the default max_num_seqs) take W @ x.T on CPU in float32; prefill chunks, other dtypes
and devices call `F.linear`, bit for bit as before. Both orientations give bit-identical
results for 1 and >= 12 rows; for 2..9 rows they differ in summation order (~1e-6 relative).

The "cpu" linear backend (`CpuGemm`, `--linear-backend`) replaces both for decode steps of up to
`KERNEL_ROWS` rows: the C decode GEMM (kernels/gemm.c) streams each weight row once per step and
reads bf16 weights directly (torch's bf16 GEMMs are emulated on CPUs without native bf16).
Measured on the 2-core AVX2 machine (AMD EPYC, torch 2.13, SmolLM2-135M shapes, ms per step's
projections, medians of interleaved rounds): bench/results/gemm.md.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

TRANSPOSED_ROWS = range(2, 33)  # row counts that take W @ x.T (the table above)
KERNEL_ROWS = 32  # the most rows the C decode GEMM takes (the default max_num_seqs); larger: MKL
WIDENED_BF16_KERNEL_ROWS = 128  # the same for bf16 on a CPU without native bf16 (bench/results/gemm.md)
LINEAR_BACKENDS = ("torch", "cpu")
log = logging.getLogger(__name__)


class CpuGemm:
    """The C decode GEMM (kernels/gemm.c): y = x @ W.T (+ b) for decode-sized batches on the CPU.

    W (and b) float32 or bfloat16; x of W's dtype (a bf16 x is widened to float32, exactly); y of
    W's dtype, summed in float32 and rounded once. In the kernel each output is summed in one fixed
    order whatever the batch (kernels/gemm.c): within steps the kernel takes, a row's numbers do
    not depend on its batch (larger steps go to MKL, whose order differs).

    Batches of up to KERNEL_ROWS rows run in the kernel. bf16 on a CPU without native bf16
    (`native_bf16` False: no AVX512-BF16 or AMX, where torch's bf16 GEMMs are emulated) runs in the
    kernel up to WIDENED_BF16_KERNEL_ROWS rows and, above that, as an MKL float32 GEMM of the exactly
    widened operands, rounded once: the same sum in another order.

    Raises (constructor): RuntimeError as `native.load` (no C compiler with OpenMP).
    """

    def __init__(self, native_bf16: bool | None = None) -> None:
        """`native_bf16`: whether the CPU computes bf16 natively (None: read /proc/cpuinfo)."""
        from tessera.decoder.kernels import native

        library = native.load()
        self._kernels = {torch.float32: library.tessera_gemm_f32, torch.bfloat16: library.tessera_gemm_bf16}
        self.native_bf16 = native.cpu_has_bf16() if native_bf16 is None else native_bf16
        self._rows = {torch.float32: KERNEL_ROWS,
                      torch.bfloat16: KERNEL_ROWS if self.native_bf16 else WIDENED_BF16_KERNEL_ROWS}

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `x` [rows, in] @ `weight` [out, in] is this backend's: on the CPU in a dtype it
        computes, and a decode-sized batch (any batch for bf16 without native bf16)."""
        if not (x.dim() == 2 and weight.dim() == 2 and x.shape[0] > 0 and x.shape[1] == weight.shape[1]
                and x.device.type == "cpu" and weight.device.type == "cpu" and weight.dtype in self._kernels
                and x.dtype == weight.dtype and weight.is_contiguous()):
            return False
        return x.shape[0] <= self._rows[weight.dtype] or (weight.dtype == torch.bfloat16 and not self.native_bf16)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in], weight [out, in], bias [out] or None -> y [rows, out] (contiguous); the
        caller checked `takes`."""
        if x.shape[0] > self._rows[weight.dtype]:  # bf16, no native bf16: MKL float32 on widened operands
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(weight.dtype)
        if bias is not None:
            if bias.shape != weight.shape[:1]:
                raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
            bias = bias.to("cpu", weight.dtype).contiguous()
        x = x.float().contiguous()  # a view of x when already float32 and contiguous
        y = torch.empty(x.shape[0], weight.shape[0], dtype=weight.dtype, device="cpu")
        self._kernels[weight.dtype](x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(),
                                    None if bias is None else bias.data_ptr(), y.data_ptr(), weight.shape[0],
                                    torch.get_num_threads())
        return y


def make_linear_backend(name: str) -> CpuGemm | None:
    """The GEMM for `--linear-backend name`: a CpuGemm for "cpu", None (torch) for "torch".

    Raises:
        ValueError: an unknown name.
        RuntimeError: "cpu" where the C kernels do not build.
    """
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    return CpuGemm() if name == "cpu" else None


def resolve_linear_backend(name: str, device: torch.device, dtype: str) -> str:
    """`name` itself, or for "auto" the fastest that runs: "cpu" on a CPU without AVX-512 where the
    C kernels build with the AVX2 + FMA decode GEMM and compute `dtype` (built now), else "torch".
    The kernel is AVX2 code: it beat MKL on an AVX2-only CPU (bench/results/gemm.md) and has not
    been measured against AVX-512 MKL or native bf16, so those CPUs keep torch. An automatic choice
    is logged with its reason."""
    if name != "auto":
        return name
    reason = None
    if device.type == "cpu":
        from tessera.decoder.kernels import native

        reason = native.unavailable(dtype)
        if reason is None and native.gemm_variant() != "avx2":
            reason = "the decode GEMM was built without AVX2 + FMA (scalar code is slower than MKL)"
        elif reason is None and "avx512f" in native.cpu_flags():
            reason = "the CPU has AVX-512: MKL's AVX-512 GEMMs stay (the AVX2 kernel is unmeasured there)"
    else:
        reason = f"no decode GEMM kernel for {device.type} devices"
    choice = "cpu" if reason is None else "torch"
    log.info("linear_backend auto: %s on %s for %s%s", choice, device, dtype, f" ({reason})" if reason else "")
    return choice


def attach_gemm(model: nn.Module, gemm: CpuGemm | None) -> None:
    """Point every module of `model` with a `gemm` attribute (LoRALinear, the causal LM's lm_head
    projection) at `gemm` (None: torch)."""
    for module in model.modules():
        if hasattr(module, "gemm"):
            module.gemm = gemm


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gemm: CpuGemm | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [rows, in], weight [out, in], bias [out] -> [rows, out], row-major.

    `gemm`: the C decode GEMM, for the inputs it takes (`CpuGemm.takes`). Inputs of another rank,
    dtype or device go to `F.linear` unchanged.
    """
    if gemm is not None and gemm.takes(x, weight):
        return gemm(x, weight, bias)
    if x.dim() != 2 or x.shape[0] not in TRANSPOSED_ROWS or x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(weight, x.t()).t().contiguous()
    return torch.addmm(bias[:, None], weight, x.t()).t().contiguous()
