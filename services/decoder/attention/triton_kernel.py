"""Paged attention as a Triton kernel (GPU backend; runs on CPU under TRITON_INTERPRET=1 for tests).

One program per (query row, head). Query row t belongs to sequence `token_seq[t]` and sees cache
positions [0, context_lens[t]) -- position + 1 for causal prefill rows, the whole context for a
decode row. Positions are read block by block through the block table:

    position p -> slot = block_tables[seq, p // BLOCK] * BLOCK + p % BLOCK    (flat cache row)

with an online (running max / running sum) softmax, so no [ctx] score vector is materialized. With a
sliding window W a row reads positions [max(0, context_len - W), context_len) only (blocks before it
may be freed); with a soft cap C the scores become C * tanh(scores / C) before the mask.
Grouped-query heads read kv head h // (heads / kv_heads), as in transformers' `repeat_kv`.
Masks use `tl.where` on loaded values and `other=` on loads only (the interpreter evaluates
masked-out addresses too, so every address stays inside the tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, token_seq_ptr, context_lens_ptr,
                            scale, num_rep, max_blocks, window, soft_cap,
                            stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh,
                            HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK: tl.constexpr,
                            HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // num_rep
    seq = tl.load(token_seq_ptr + row)
    context_len = tl.load(context_lens_ptr + row)
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    offsets = tl.arange(0, BLOCK)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((HEAD_DIM_P2,), tl.float32)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(context_len - window, 0)  # the first position this row attends
    for b in range(first // BLOCK, tl.cdiv(context_len, BLOCK)):
        block = tl.load(tables_ptr + seq * max_blocks + b)
        slots = block * BLOCK + offsets                                        # [BLOCK]
        kv_off = slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :]  # [BLOCK, HEAD_DIM_P2]
        k = tl.load(k_ptr + kv_off, mask=d_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=d_ok[None, :], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale                         # [BLOCK]
        if HAS_CAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both infinities
            scores = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / soft_cap) + 1.0))
        position = b * BLOCK + offsets
        scores = tl.where((position < context_len) & (position >= first), scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def triton_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, token_seq: torch.Tensor, context_lens: torch.Tensor,
                           block_size: int, scale: float, sliding_window: int | None = None,
                           logits_soft_cap: float | None = None) -> torch.Tensor:
    """Attention of `query` [num_tokens, heads, head_dim] over head-major caches [kv_heads, slots, head_dim].

    block_tables: int32 [num_seqs, max_blocks] (unused entries may hold any valid block id);
    token_seq: int32 [num_tokens] sequence row of each query token; context_lens: int32
    [num_tokens] positions each query token attends to. `block_size` must be a power of two.
    sliding_window / logits_soft_cap as `AttentionBackend.forward` states them (None: off).
    Returns [num_tokens, heads, head_dim] in the query's dtype.
    """
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton backend needs a power-of-two block_size, got {block_size}")
    num_tokens, heads, head_dim = query.shape
    query = query.contiguous()
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if k_cache.stride() != v_cache.stride() or k_cache.stride(2) != 1:
        raise ValueError("k_cache and v_cache must share strides with contiguous head_dim")
    _paged_attention_kernel[(num_tokens, heads)](
        query, k_cache, v_cache, out, block_tables.contiguous(), token_seq, context_lens,
        scale, heads // k_cache.shape[0], block_tables.shape[1], sliding_window or 0, logits_soft_cap or 1.0,
        query.stride(0), query.stride(1), k_cache.stride(1), k_cache.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim), BLOCK=block_size,
        HAS_WINDOW=sliding_window is not None, HAS_CAP=logits_soft_cap is not None)
    return out
