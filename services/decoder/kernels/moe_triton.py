"""The MoE experts' grouped GEMM as one Triton kernel (CUDA; runs on the CPU under TRITON_INTERPRET=1).

Rows of `x` are grouped by expert (`expert_offsets`, moe.py's `ExpertGroups`). Each expert's rows
are cut into tiles of BLOCK_M rows; the programs of grid axis 0 walk the tiles of every expert in
turn, so no tile mixes experts and an expert without rows has no tile:

    expert_offsets  [0, 5, 5, 12]        (BLOCK_M = 4; expert 1 has no rows)
    tile_offsets    [0, 2, 2, 4]         tiles of expert e: tile_offsets[e]:tile_offsets[e + 1]
    program 0 1 | 2 3 | 4 ...            expert 0 rows 0-3, 4 | expert 2 rows 5-8, 9-11 | no tile: stores nothing
    grid axis 0 = cdiv(rows, BLOCK_M) + experts   (a bound on the tiles, known without reading the offsets)

A program finds its expert by counting the experts whose tiles end at or before it, and computes
out[tile rows, BLOCK_N columns] = x[tile rows] @ weight[expert]^T with float32 accumulation (IEEE
float32 products for float32 inputs, not TF32). Masks use `tl.where` on indices and `other=` on
loads, so every address stays inside the tensors (the interpreter evaluates masked-out addresses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, expert_offsets_ptr, tile_offsets_ptr,
                         num_experts, N, K, stride_xm, stride_we, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_E: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    experts = tl.arange(0, BLOCK_E)
    tile_ends = tl.load(tile_offsets_ptr + 1 + tl.where(experts < num_experts, experts, 0),
                        mask=experts < num_experts, other=2147483647)              # [BLOCK_E]
    expert = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)
    valid = expert < num_experts
    expert = tl.minimum(expert, num_experts - 1)
    first_tile = tl.load(tile_offsets_ptr + expert)
    row_start = tl.load(expert_offsets_ptr + expert) + (tile - first_tile) * BLOCK_M
    row_end = tl.where(valid, tl.load(expert_offsets_ptr + expert + 1), 0)
    rows = row_start + tl.arange(0, BLOCK_M)                                           # [BLOCK_M]
    row_ok = rows < row_end
    safe_rows = tl.where(row_ok, rows, 0)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)                                 # [BLOCK_N]
    col_ok = cols < N
    safe_cols = tl.where(col_ok, cols, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        safe_ks = tl.where(k_ok, ks, 0)
        a = tl.load(x_ptr + safe_rows[:, None] * stride_xm + safe_ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_ptr + expert * stride_we + safe_cols[None, :] * stride_wn + safe_ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)                  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    tl.store(out_ptr + safe_rows[:, None] * stride_om + safe_cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


class TritonGroupedGemm:
    """services/decoder/moe.py's `GroupedGemm` in `_grouped_gemm_kernel` (module docstring); no host read
    of the offsets. moe.py registers it as a GroupedGemm where it imports it (this module imports
    nothing of moe.py, which imports it)."""

    def __init__(self, block_m: int = 16, block_n: int = 64, block_k: int = 32) -> None:
        self.block_m, self.block_n, self.block_k = block_m, block_n, block_k

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
        num_experts, n, k = weight.shape
        x, weight = x.contiguous(), weight.contiguous()
        out = x.new_empty(x.shape[0], n)  # [m, out]
        if x.shape[0] == 0:
            return out
        counts = expert_offsets[1:] - expert_offsets[:-1]  # [experts]
        tile_offsets = torch.zeros_like(expert_offsets)
        torch.cumsum(torch.div(counts + self.block_m - 1, self.block_m, rounding_mode="floor"), 0,
                     out=tile_offsets[1:])
        grid = (triton.cdiv(x.shape[0], self.block_m) + num_experts, triton.cdiv(n, self.block_n))
        _grouped_gemm_kernel[grid](x, weight, out, expert_offsets, tile_offsets, num_experts, n, k,
                                   x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
                                   BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                                   BLOCK_E=triton.next_power_of_2(num_experts), IEEE=x.dtype == torch.float32)
        return out
