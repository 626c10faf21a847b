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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TRANSPOSED_ROWS = range(2, 33)  # row counts that take W @ x.T (the table above)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [rows, in], weight [out, in], bias [out] -> [rows, out], row-major.

    Inputs of another rank, dtype or device go to `F.linear` unchanged.
    """
    if x.dim() != 2 or x.shape[0] not in TRANSPOSED_ROWS or x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(weight, x.t()).t().contiguous()
    return torch.addmm(bias[:, None], weight, x.t()).t().contiguous()
