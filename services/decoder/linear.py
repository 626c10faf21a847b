"""Dense projections `x @ W.T (+ b)` of a flat batch of rows, in the GEMM orientation MKL runs faster.

`F.linear` on CPU asks MKL for C[rows, out] = x[rows, in] @ W.T. For 2 to 4 rows MKL takes a
slow small-matrix path; the transposed product C.T[out, rows] = W @ x.T (then one row-major
copy) is about twice as fast. Measured on the 2-core AVX-512 CI machine, torch 2.13, SmolLM2-135M
shapes, best of 5, ms:

    rows                                1     2     4     6     8     16    32    64    256
    30 layers of projections, F.linear  35.6  52.8  46.4  40.5  44.4  50.6  67.4  107   337
    the same, W @ x.T + copy            35.6  21.0  23.9  42.2  51.7  45.6  64.6  105   376
    lm_head 576 -> 49152, F.linear       9.8  21.8  16.2  24.2  17.0  19.3  25.5  39.4  118
    lm_head, W @ x.T + copy              9.8   4.1   4.9  10.2   8.6  16.8  23.8  43.9  140

Decode steps with few running requests (the tail of a batch) take this path on CPU in float32
(what was measured); any other shape, dtype or device calls `F.linear`, bit for bit as before. For 2..4 rows the two orientations differ only in
summation order (|diff| ~1e-6 relative).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TRANSPOSED_ROWS = range(2, 5)  # row counts where W @ x.T wins (the table above)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [rows, in], weight [out, in], bias [out] -> [rows, out], row-major.

    Inputs of another rank, dtype or device go to `F.linear` unchanged.
    """
    if x.dim() != 2 or x.shape[0] not in TRANSPOSED_ROWS or x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(weight, x.t()).t().contiguous()
    return torch.addmm(bias[:, None], weight, x.t()).t().contiguous()
