"""Paged attention in torch (CPU reference): prefill per sequence, decode batched.

Both read K/V back from the cache through the block table, so a prefill chunk attends to
every earlier chunk and a recomputed request sees exactly what it wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence computing several tokens this step.

    `token_start:token_end` are its rows in the flat batch; `context_slots` [context_len] are the
    cache slots of positions 0..context_len-1 (earlier chunks + this one); `num_computed` is the
    absolute position of its first query row.
    """

    token_start: int
    token_end: int
    num_computed: int
    context_slots: torch.Tensor
    mask: torch.Tensor | None  # [query_len, context_len] bool, None when plain causal


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every layer.

    slot_mapping: int64 [num_tokens], where each new token's K/V is written.
    decode_rows: int64 [num_decodes], flat rows of single-token (decode) sequences.
    decode_slots: int64 [num_decodes, max_context] cache slots per row (padding points at slot 0).
    decode_mask: bool [num_decodes, 1, 1, max_context], True where the slot is real context; None
        when no row is padded.
    """

    slot_mapping: torch.Tensor
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    triton: "TritonMetadata | None" = None  # set: the Triton kernel runs instead of the torch path


@dataclass
class TritonMetadata:
    """Inputs of `triton_paged_attention`: block_tables int32 [num_seqs, max_blocks] (padded with
    block 0), token_seq int32 [num_tokens], context_lens int32 [num_tokens] (query position + 1)."""

    block_tables: torch.Tensor
    token_seq: torch.Tensor
    context_lens: torch.Tensor
    block_size: int


def prefill_span(token_start: int, num_computed: int, context_slots: torch.Tensor) -> PrefillSpan:
    """Span for query positions [num_computed, len(context_slots)) with a causal-with-prefix mask."""
    context_len = int(context_slots.numel())
    query_len = context_len - num_computed
    mask = None
    if num_computed > 0:
        query_pos = torch.arange(num_computed, context_len)[:, None]  # [query_len, 1]
        mask = torch.arange(context_len)[None, :] <= query_pos         # [query_len, context_len]
    return PrefillSpan(token_start, token_start + query_len, num_computed, context_slots, mask)


def decode_batch(context_slots: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pad per-row context slots into ([rows, max_context] slots, [rows, 1, 1, max_context] mask);
    the mask is None when every row has the same context length (no padding: SDPA's faster path)."""
    sizes = [s.numel() for s in context_slots]
    max_len = max(sizes)
    if min(sizes) == max_len:
        return torch.stack(context_slots), None
    slots = torch.zeros(len(context_slots), max_len, dtype=torch.long)
    for row, s in enumerate(context_slots):
        slots[row, : s.numel()] = s
    mask = torch.arange(max_len)[None, :] < torch.tensor(sizes)[:, None]
    return slots, mask[:, None, None, :]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of `query` [num_tokens, heads, head_dim] over the slot-indexed caches.

    `k_cache`/`v_cache` are flat [slots, kv_heads, head_dim] (already holding this step's K/V).
    Grouped-query heads share KV as in transformers' `repeat_kv` (head h reads kv head
    h // (heads / kv_heads)). Returns [num_tokens, heads, head_dim]. With `meta.triton` set the
    Triton kernel computes the same result (see triton_attention.py).
    """
    if meta.triton is not None:
        from services.decoder.triton_attention import triton_paged_attention  # optional dependency

        t = meta.triton
        return triton_paged_attention(query, k_cache, v_cache, t.block_tables, t.token_seq, t.context_lens,
                                      t.block_size, scale)
    num_rep = query.shape[1] // k_cache.shape[1]
    if not meta.prefills and meta.decode_rows is not None and meta.decode_rows.numel() == query.shape[0]:
        return _decode(query, k_cache, v_cache, meta, num_rep, scale)  # every row decodes: no scatter
    out = torch.empty_like(query)
    for span in meta.prefills:
        # 4-D inputs with enable_gqa: SDPA's CPU flash kernel (3-D inputs, or K/V repeated per
        # head, fall back to the slower math path)
        q = query[span.token_start:span.token_end].transpose(0, 1)[None]  # [1, heads, q_len, head_dim]
        k = k_cache.index_select(0, span.context_slots).transpose(0, 1)[None]  # [1, kv_heads, ctx, head_dim]
        v = v_cache.index_select(0, span.context_slots).transpose(0, 1)[None]
        if span.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=num_rep > 1)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scale, enable_gqa=num_rep > 1)
        out[span.token_start:span.token_end] = o[0].transpose(0, 1)
    if meta.decode_rows is not None and meta.decode_rows.numel():
        out.index_copy_(0, meta.decode_rows, _decode(query.index_select(0, meta.decode_rows), k_cache, v_cache,
                                                     meta, num_rep, scale))
    return out


def _decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            num_rep: int, scale: float) -> torch.Tensor:
    """Decode rows' attention: `query` [rows, heads, head_dim] (one token per row) -> same shape.

    The `num_rep` heads sharing a kv head become that kv head's query rows, so K/V are gathered
    once per kv head and never repeated; `index_select` over the flattened slots is a plain row
    copy (several times faster on CPU than advanced indexing).
    """
    rows, heads, head_dim = query.shape
    slots = meta.decode_slots.reshape(-1)  # [rows * max_context]
    q = query.view(rows, heads // num_rep, num_rep, head_dim)                       # [rows, kv_heads, rep, d]
    k = k_cache.index_select(0, slots).view(rows, -1, *k_cache.shape[1:]).transpose(1, 2)  # [rows, kv, ctx, d]
    v = v_cache.index_select(0, slots).view(rows, -1, *v_cache.shape[1:]).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scale)
    return o.reshape(rows, heads, head_dim)
