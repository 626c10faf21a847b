"""Triton multi-LoRA kernels: BGMV for decode rows, SGMV (tiled matmul) for prefill segments.

Shrink computes s = x @ A[slot].T into a float32 scratch [rows, max_rank]; expand adds
s @ B[slot].T into y. BGMV runs one program per decode row (a matrix-vector product against
its own slot). SGMV runs one program per (segment, BLOCK_M rows) of the slot-sorted prefill
rows, so a segment's A/B tiles are loaded once for BLOCK_M rows and multiplied with tl.dot.
Slot -1 rows are masked (no load, no store), so base rows of y stay bit-identical.

Every kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, read when this module is
imported) as well as on a GPU. The interpreter rejects a scalar bool ANDed into a block mask, so
"slot >= 0" is broadcast as a block (`offs * 0 + slot >= 0`); there are no scalar early returns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.decoder.lora.backend import LoRABackend
from services.decoder.lora.batch import LoRABatch

BLOCK_M = 16   # rows per SGMV program (tl.dot needs >= 16 on GPUs)
BLOCK_K = 64   # reduction tile over in_features
BLOCK_N = 64   # output tile over out_features


@triton.jit
def _bgmv_shrink(x_ptr, a_ptr, rows_ptr, slots_ptr, s_ptr, K, R,
                 stride_xm, stride_as, stride_ar, stride_sm,
                 BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.load(rows_ptr + pid)
    slot_in = tl.load(slots_ptr + pid)
    slot = tl.maximum(slot_in, 0)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = (offs_r < R) & (offs_r * 0 + slot_in >= 0)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = (k < K) & (offs_k * 0 + slot_in >= 0)
        x = tl.load(x_ptr + row * stride_xm + k, mask=k_mask, other=0.0).to(tl.float32)          # [BK]
        a = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + k[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)           # [BR, BK]
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(s_ptr + pid * stride_sm + offs_r, acc, mask=offs_r < R)


@triton.jit
def _bgmv_expand(s_ptr, b_ptr, rows_ptr, slots_ptr, y_ptr, N, R,
                 stride_sm, stride_bs, stride_bn, stride_br, stride_ym,
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    row = tl.load(rows_ptr + pid)
    slot_in = tl.load(slots_ptr + pid)
    slot = tl.maximum(slot_in, 0)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = (offs_r < R) & (offs_r * 0 + slot_in >= 0)
    n_mask = (offs_n < N) & (offs_n * 0 + slot_in >= 0)
    s = tl.load(s_ptr + pid * stride_sm + offs_r, mask=r_mask, other=0.0)                         # [BR]
    b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)               # [BN, BR]
    delta = tl.sum(b * s[None, :], axis=1)
    y_ptrs = y_ptr + row * stride_ym + offs_n
    y = tl.load(y_ptrs, mask=n_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


@triton.jit
def _sgmv_shrink(x_ptr, a_ptr, perm_ptr, starts_ptr, lens_ptr, slots_ptr, s_ptr, K, R,
                 stride_xm, stride_as, stride_ar, stride_sm,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    length = tl.load(lens_ptr + seg)
    slot_in = tl.load(slots_ptr + seg)
    slot = tl.maximum(slot_in, 0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = (offs_m < length) & (offs_m * 0 + slot_in >= 0)
    r_mask = offs_r < R
    rows = tl.load(perm_ptr + start + offs_m, mask=m_mask, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)           # [BM, BK]
        a_mask = k_mask[:, None] & r_mask[None, :] & (offs_r[None, :] * 0 + slot_in >= 0)
        a = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + k[:, None],
                    mask=a_mask, other=0.0).to(tl.float32)                                      # [BK, BR]
        acc += tl.dot(x, a, input_precision="ieee")
    s_ptrs = s_ptr + (start + offs_m)[:, None] * stride_sm + offs_r[None, :]
    tl.store(s_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _sgmv_expand(s_ptr, b_ptr, perm_ptr, starts_ptr, lens_ptr, slots_ptr, y_ptr, N, R,
                 stride_sm, stride_bs, stride_bn, stride_br, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    length = tl.load(lens_ptr + seg)
    slot_in = tl.load(slots_ptr + seg)
    slot = tl.maximum(slot_in, 0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = (offs_m < length) & (offs_m * 0 + slot_in >= 0)
    n_mask = offs_n < N
    r_mask = offs_r < R
    rows = tl.load(perm_ptr + start + offs_m, mask=m_mask, other=0)
    s = tl.load(s_ptr + (start + offs_m)[:, None] * stride_sm + offs_r[None, :],
                mask=m_mask[:, None] & r_mask[None, :], other=0.0)                               # [BM, BR]
    b_mask = r_mask[:, None] & n_mask[None, :] & (offs_r[:, None] * 0 + slot_in >= 0)
    b = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                mask=b_mask, other=0.0).to(tl.float32)                                          # [BR, BN]
    delta = tl.dot(s, b, input_precision="ieee")                                                # [BM, BN]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def bgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         rows: torch.Tensor, slots: torch.Tensor) -> None:
    """y[rows[i]] += x[rows[i]] @ a[slots[i]].T @ b[slots[i]].T for each i with slots[i] >= 0.

    x [T, in], y [T, out] (last dim contiguous); a [S, R, in] contiguous; b [S, out, R], any strides
    (AdapterSlots stores it as the transposed view of a contiguous [S, R, out]);
    rows, slots int64 [n]. Rows must be distinct.
    """
    n = rows.numel()
    if n == 0:
        return
    rank, in_f, out_f = a.shape[1], a.shape[2], b.shape[1]
    shrunk = torch.empty(n, rank, dtype=torch.float32, device=x.device)  # [n, max_rank]
    br = _block_r(rank)
    _bgmv_shrink[(n,)](x, a, rows, slots, shrunk, in_f, rank, x.stride(0), a.stride(0), a.stride(1),
                       shrunk.stride(0), BLOCK_K=BLOCK_K, BLOCK_R=br)
    _bgmv_expand[(n, triton.cdiv(out_f, BLOCK_N))](shrunk, b, rows, slots, y, out_f, rank, shrunk.stride(0),
                                                    b.stride(0), b.stride(1), b.stride(2), y.stride(0),
                                                    BLOCK_N=BLOCK_N, BLOCK_R=br)


def sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, perm: torch.Tensor,
         seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int) -> None:
    """For each segment g and i < seg_lens[g], row t = perm[seg_starts[g] + i] with s = seg_slots[g] >= 0:
    y[t] += x[t] @ a[s].T @ b[s].T. Shapes as in `bgmv`; perm int64 [n] distinct rows; segment
    tensors int64 [num_segments]; max_seg_len = max(seg_lens) (host int, sizes the grid).
    """
    num_segments = seg_slots.numel()
    if num_segments == 0 or max_seg_len == 0:
        return
    rank, in_f, out_f = a.shape[1], a.shape[2], b.shape[1]
    shrunk = torch.empty(perm.numel(), rank, dtype=torch.float32, device=x.device)  # [n, max_rank], perm order
    br = _block_r(rank)
    m_blocks = triton.cdiv(max_seg_len, BLOCK_M)
    _sgmv_shrink[(num_segments, m_blocks)](x, a, perm, seg_starts, seg_lens, seg_slots, shrunk, in_f, rank,
                                           x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
                                           BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=br)
    _sgmv_expand[(num_segments, m_blocks, triton.cdiv(out_f, BLOCK_N))](
        shrunk, b, perm, seg_starts, seg_lens, seg_slots, y, out_f, rank, shrunk.stride(0),
        b.stride(0), b.stride(1), b.stride(2), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=br)


class TritonLoRABackend(LoRABackend):
    """BGMV over the step's decode rows, SGMV over its slot-sorted prefill segments."""

    name = "triton"

    def add_lora(self, y, x, a, b, batch: LoRABatch) -> None:
        if x.stride(-1) != 1:
            x = x.contiguous()
        if y.stride(-1) != 1:
            raise ValueError("LoRA output must have a contiguous last dimension")
        bgmv(y, x, a, b, batch.decode_rows, batch.decode_slots)
        sgmv(y, x, a, b, batch.prefill_perm, batch.seg_starts, batch.seg_lens, batch.seg_slots, batch.max_seg_len)
