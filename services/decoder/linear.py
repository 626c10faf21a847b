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
and devices call `F.linear`. Both orientations give bit-identical
results for 1 and >= 12 rows; for 2..9 rows they differ in summation order (~1e-6 relative).

The "cpu" linear backend (`--linear-backend`) replaces both, for every step, decode and prefill:
each weight is packed once, at load, into the panels of the C GEMM (kernels/gemm.c, a BLIS-style
6 x 16 AVX2 micro-kernel) and the row-major copy is released, so the model holds one copy of its
weights either way. The kernel reads bf16 weights directly (torch's bf16 GEMMs are emulated on CPUs
without native bf16) and sums every output in one order whatever the batch. Measured on the 2-core
AVX2 machine (AMD EPYC, torch 2.13, SmolLM2-135M shapes, medians of interleaved rounds):
bench/results/gemm.md.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

TRANSPOSED_ROWS = range(2, 33)  # row counts that take W @ x.T (the table above)
PANEL_WIDTH = 16  # output columns per packed panel (kernels/gemm.c NR)
# where a bfloat16 panel row stores column j (kernels/gemm.c BF16_POS: the middle groups of four
# swap, so AVX2's per-lane interleaves widen it in column order); a permutation that is its own inverse
BF16_PANEL_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)
LINEAR_BACKENDS = ("torch", "cpu", "triton")
log = logging.getLogger(__name__)


class PackedWeight:
    """A weight [out, in] packed for the C GEMM, callable as y = x @ W.T (+ b).

    `panels` [ceil(out / PANEL_WIDTH), in, PANEL_WIDTH] of the weight's dtype (float32 or bfloat16):
    panels[p][k][j] = W[p * PANEL_WIDTH + j][k], zero past `out_features` (kernels/gemm.c); for
    bfloat16 the last dimension is then stored in BF16_PANEL_ORDER.
    """

    def __init__(self, kernel, weight: torch.Tensor) -> None:
        out_features, in_features = weight.shape
        full, tail = divmod(out_features, PANEL_WIDTH)
        self.panels = weight.new_zeros(full + (tail > 0), in_features, PANEL_WIDTH)  # one copy, zero past the end
        source = weight.detach()
        self.panels[:full].copy_(source[:full * PANEL_WIDTH].view(full, PANEL_WIDTH, in_features).transpose(1, 2))
        if tail:
            self.panels[full, :, :tail].copy_(source[full * PANEL_WIDTH:].t())
        if weight.dtype == torch.bfloat16:  # a panel row at a time: no second copy of the weight
            order = torch.tensor(BF16_PANEL_ORDER)
            for panel in self.panels:
                panel.copy_(panel[:, order])
        self.out_features, self.in_features, self.dtype = out_features, in_features, weight.dtype
        self._kernel = kernel

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] of the weight's dtype on the CPU, bias [out] or None -> y [rows, out] of the
        weight's dtype, contiguous: the float32 sums rounded once (a bf16 x is widened exactly).

        Raises:
            ValueError: x not [rows, in] on the CPU in the weight's dtype, or bias not [out] (the
                weight's row-major copy was released: there is nothing to fall back to).
        """
        if x.dim() != 2 or x.shape[1] != self.in_features or x.device.type != "cpu" or x.dtype != self.dtype:
            raise ValueError(f"the packed GEMM takes x [rows, {self.in_features}] {self.dtype} on the CPU, "
                             f"got {tuple(x.shape)} {x.dtype} on {x.device}")
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
            bias = bias.to("cpu", self.dtype).contiguous()
        x = x.float().contiguous()  # a view of x when already float32 and contiguous
        y = torch.empty(x.shape[0], self.out_features, dtype=self.dtype, device="cpu")
        if x.shape[0]:
            self._kernel(x.data_ptr(), x.shape[0], x.shape[1], self.panels.data_ptr(),
                         None if bias is None else bias.data_ptr(), y.data_ptr(), self.out_features,
                         torch.get_num_threads())
        return y


class CpuGemm:
    """The C GEMM (kernels/gemm.c): packs weights (`pack`) for y = x @ W.T (+ b) on the CPU.

    Raises (constructor): RuntimeError as `native.load` (no C compiler with OpenMP), or a library
    whose panel width is not PANEL_WIDTH.
    """

    def __init__(self) -> None:
        from services.decoder.kernels import native

        library = native.load()
        if library.tessera_gemm_panel_width() != PANEL_WIDTH:
            raise RuntimeError(f"kernels/gemm.c packs {library.tessera_gemm_panel_width()} columns per panel, "
                               f"linear.py {PANEL_WIDTH}")
        self._kernels = {torch.float32: library.tessera_gemm_f32, torch.bfloat16: library.tessera_gemm_bf16}

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """weight [out, in] float32 or bfloat16 on the CPU -> its PackedWeight (a copy; `weight` is
        left as it is). Raises ValueError for another rank, dtype or device."""
        if weight.dim() != 2 or weight.dtype not in self._kernels or weight.device.type != "cpu":
            raise ValueError(f"the C GEMM packs [out, in] float32 or bfloat16 weights on the CPU, "
                             f"got {tuple(weight.shape)} {weight.dtype} on {weight.device}")
        return PackedWeight(self._kernels[weight.dtype], weight)


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear`: the packed C GEMM once `attach_gemm` set `gemm`."""

    gemm: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.gemm)


def make_linear_backend(name: str) -> CpuGemm | None:
    """The GEMM for `--linear-backend name`'s dense weights: a CpuGemm for "cpu", None (torch) for
    "torch" and "triton" (whose Triton kernels multiply GGUF blocks only: quantized_model.to_triton).

    Raises:
        ValueError: an unknown name.
        RuntimeError: "cpu" where the C kernels do not build.
    """
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    return CpuGemm() if name == "cpu" else None


def resolve_linear_backend(name: str, device: torch.device, dtype: str, quantized: bool = False) -> str:
    """`name` itself, or for "auto" the fastest that runs: on a CPU where the C kernels build with
    the AVX2 + FMA GEMM and compute `dtype` (built now), "cpu" unless torch's own GEMM for `dtype`
    runs AVX-512 code here, else "torch"; on a GPU "triton" for a model holding GGUF blocks
    (`quantized`: its dequantize-in-the-GEMM kernels). An automatic choice is logged with its reason.

    The C GEMM is AVX2 code. It beat MKL on an AVX2-only CPU (bench/results/gemm.md); torch's
    float32 GEMM is MKL's, which runs its AVX-512 kernels on Intel CPUs only (elsewhere its AVX2
    "zen" ones: on a 2-core AMD EPYC with AVX-512 the C GEMM served P1 1.45x faster, batch 1 0.94x,
    bench/results/linear_backend.md); torch's bfloat16 GEMM is oneDNN's, which computes in
    AVX512-BF16 / AMX wherever the CPU has them (there it served P1 1.13x faster than the C GEMM)
    and emulates them elsewhere (0.15-0.27x the C GEMM's speed, gemm.md). So "cpu" for float32
    without AVX-512 or on a CPU that is not Intel's, and for bfloat16 without native bf16."""
    if name != "auto":
        return name
    reason = None
    if device.type == "cpu":
        from services.decoder.kernels import native

        reason = native.unavailable(dtype)
        if reason is None and native.gemm_variant() != "avx2":
            reason = "the C GEMM was built without AVX2 + FMA (scalar code is slower than MKL)"
        elif reason is None and dtype == "bfloat16" and native.cpu_has_bf16():
            reason = "torch's bfloat16 GEMM (oneDNN) computes in AVX512-BF16 / AMX here"
        elif (reason is None and dtype != "bfloat16" and "avx512f" in native.cpu_flags()
              and native.cpu_vendor() == "GenuineIntel"):
            reason = "an Intel CPU with AVX-512: MKL's AVX-512 GEMMs stay"
    elif quantized:
        log.info("linear_backend auto: triton on %s for %s (GGUF blocks: the Triton dequantize-in-the-GEMM kernels)",
                 device, dtype)
        return "triton"
    else:
        reason = f"no C GEMM for {device.type} devices"
    choice = "cpu" if reason is None else "torch"
    log.info("linear_backend auto: %s on %s for %s%s", choice, device, dtype, f" ({reason})" if reason else "")
    return choice


def attach_gemm(model: nn.Module, gemm: CpuGemm | None) -> None:
    """Pack the weight of every `Linear` of `model` (projections, the lm_head) for `gemm` and release
    its row-major copy, unless a module other than a Linear shares it (a tied lm_head keeps the
    embedding's); Linears sharing one weight share its packed copy. None (the torch backend) changes
    nothing. Once packed, a model runs on this backend only.

    Raises:
        ValueError: `gemm` None for a model already packed (its row-major weights are gone).
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if gemm is None:
        if any(isinstance(m.gemm, PackedWeight) for m in linears):  # GGUF blocks (quant.py) run either way
            raise ValueError("this model's weights were packed for the cpu linear backend; load it again for torch")
        return
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    packed: dict[int, PackedWeight] = {}
    for module in linears:
        if module.gemm is None:
            key = id(module.weight)
            if key not in packed:
                packed[key] = gemm.pack(module.weight)
            module.gemm = packed[key]
            if key not in shared:
                module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gemm: PackedWeight | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [rows, in], weight [out, in], bias [out] -> [rows, out], row-major.

    `gemm`: the weight packed for the C GEMM (which then computes, whatever the rows; `weight` is
    not read). Raises ValueError as `PackedWeight.__call__`.
    """
    if gemm is not None:
        return gemm(x, bias)
    if x.dim() != 2 or x.shape[0] not in TRANSPOSED_ROWS or x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(weight, x.t()).t().contiguous()
    return torch.addmm(bias[:, None], weight, x.t()).t().contiguous()
