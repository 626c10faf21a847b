"""The torch attention backend (CPU default): prefill per sequence, decode batched in length groups.

Both read K/V back from the cache through slots, so a prefill chunk attends to every earlier
chunk and a recomputed request sees exactly what it wrote (a bfloat16 cache under a float32 model,
--kv-cache-dtype bfloat16, is widened to the query's dtype as it is read). The cache is head-major (see
kv_cache.py): one layer's K is [kv_heads, slots, head_dim], viewed flat as [kv_heads * slots,
head_dim], so gathering rows yields K already laid out heads-first for SDPA, with no transpose copy.

Decode rows are sorted by context length and cut into groups, each padded only to its own
longest context (`plan_decode`): with contexts 150..450 one padded batch would gather a third
more K/V than the rows hold. Each group gathers its K/V by whole blocks: a block of one kv head
is block_size consecutive rows of the head-major cache, so the gather copies rows of
block_size * head_dim values (~4x faster than gathering slot by slot). A group's gathered K/V
is kept under a few MB (`MAX_GROUP_BYTES`), so the two matmuls read it back from cache
rather than memory: in one SmolLM2 decode forward at 32 rows x 450 positions, fp32, gathers
plus score matmuls took 147 ms with one gather for all groups and 57 ms in capped groups
(2-core CI machine).

    cache (one layer) viewed as [kv_heads * num_blocks, block_size * head_dim]
    decode_index = [ group 0: head 0 [row 0 blocks | row 1 blocks ...] | head 1 ... | group 1 ... ]
    row r, block j, head h  ->  cache row  h * num_blocks + block_table[r][j]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.decoder.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    cache_slot,
    cache_slots,
    check_attention_options,
)

if TYPE_CHECKING:
    from services.decoder.kv_cache import KVCache
    from services.decoder.scheduler import ScheduledRequest

# A group costs a few ops per layer; in gathered positions that is about this many (one SDPA call
# and two row copies ~ 40 us; one position of K and V for all kv heads ~ 0.17 us on CPU).
GROUP_COST_POSITIONS = 256
# A decode group's gathered K + V (in the score dtype, float32 at least) stay under this many
# bytes: well inside the L3 cache of the machines we measured (32 MB, 2-core CI machine).
MAX_GROUP_BYTES = 4 << 20


def decode_group_cap(head_dim: int, dtype: torch.dtype) -> int:
    """`plan_decode`'s cap for a cache of `head_dim` and `dtype`: K + V of that many positions in
    the score dtype (half precision is upcast to float32 in `decode_attention`) take MAX_GROUP_BYTES."""
    element = max(torch.finfo(dtype).bits // 8, 4)
    return max(1, MAX_GROUP_BYTES // (2 * head_dim * element))


MAX_GROUP_POSITIONS = decode_group_cap(64, torch.float32)  # plan_decode's default: 8192


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

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """[query_len, context_len] bool, True where a query attends (causal with the earlier positions
        as a prefix); None when plain causal (num_computed 0). Built on first use: the torch path's
        SDPA reads it, the C prefill kernel (cpu backend) needs none."""
        if self.num_computed == 0:
            return None
        context_len = int(self.context_slots.numel())
        query_pos = torch.arange(self.num_computed, context_len)[:, None]  # [query_len, 1]
        return torch.arange(context_len)[None, :] <= query_pos            # [query_len, context_len]


@dataclass
class DecodeGroup:
    """Decode rows padded to one context length. Their K/V, laid out [kv_heads, n, L, head_dim], are the
    blocks decode_index[start // block_size:(start + kv_heads * n * L) // block_size]."""

    rows: torch.Tensor           # int64 [n] flat-batch rows
    context_len: int             # L: the group's longest context rounded up to whole blocks
    padding: torch.Tensor | None  # bool [1, n, 1, L]: True on padding positions (their scores become -inf); None: none
    start: int
    first_row: int | None = None  # set when rows are first_row, first_row + 1, ...: slices, no row gather
    context_lens: torch.Tensor | None = None  # int64 [n]: each row's context (its query position + 1)

    def masked(self, sliding_window: int | None) -> torch.Tensor | None:
        """bool [1, n, 1, L]: True where a row's score becomes -inf (padding, and with `sliding_window`
        positions kv <= position - sliding_window); None: nothing masked."""
        if sliding_window is None:
            return self.padding
        before = torch.arange(self.context_len)[None, :] < (self.context_lens - sliding_window)[:, None]  # [n, L]
        before = before[None, :, None, :]
        return before if self.padding is None else before | self.padding


@dataclass(kw_only=True)
class TorchAttentionMetadata(AttentionMetadata):
    """The torch backend's step: prefill spans, and decode rows in length groups (see `plan_decode`)."""

    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    decode_index: torch.Tensor | None = None
    block_size: int = 0


def prefill_span(token_start: int, num_computed: int, context_slots: torch.Tensor) -> PrefillSpan:
    """Span for query positions [num_computed, len(context_slots)) (causal; `PrefillSpan.mask`)."""
    query_len = int(context_slots.numel()) - num_computed
    return PrefillSpan(token_start, token_start + query_len, num_computed, context_slots)


def plan_decode(rows: list[int], block_tables: list[list[int]], context_lens: list[int], block_size: int,
                num_kv_heads: int, num_blocks: int,
                max_group_positions: int = MAX_GROUP_POSITIONS) -> tuple[list[DecodeGroup], torch.Tensor]:
    """Group decode rows by context length; returns (groups, decode_index int64 [sum kv * n * L / block_size]).

    rows[i] is a flat-batch row whose context is positions [0, context_lens[i]) in blocks
    `block_tables[i]` (at least ceil(len / block_size) ids). Rows are sorted by length and split
    where a split saves more padded positions than GROUP_COST_POSITIONS (dynamic programming
    over the sorted lengths, in whole blocks); a group is then cut into consecutive parts of
    at most `max_group_positions` gathered positions (kv heads x rows x padded length; one row
    at least). Padding reads block 0 and its scores are set to -inf (`masked_fill`, not an added
    bias: whatever a padded slot holds, even NaN/inf left by another request, never reaches a score). Group g's blocks are decode_index[g.start // block_size:
    (g.start + kv_heads * n * L) // block_size].
    """
    order = sorted(range(len(rows)), key=lambda i: (context_lens[i], rows[i]))
    num_table_blocks = [-(-context_lens[i] // block_size) for i in order]  # blocks each sorted row reads
    # best[j]: cheapest cost of the first j sorted rows; cut[j]: where their last group starts
    best, cut = [0] + [0] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        width = num_table_blocks[j - 1] * block_size
        best[j], cut[j] = min((best[i] + (j - i) * width + GROUP_COST_POSITIONS, i) for i in range(j))
    bounds, j = [], len(order)
    while j > 0:
        width = num_table_blocks[j - 1] * block_size
        step = max(1, max_group_positions // (num_kv_heads * width))
        bounds.extend((lo, min(lo + step, j)) for lo in reversed(range(cut[j], j, step)))
        j = cut[j]
    heads = torch.arange(num_kv_heads)[:, None, None] * num_blocks  # [kv_heads, 1, 1]
    groups, index, start = [], [], 0
    for lo, hi in reversed(bounds):
        members = order[lo:hi]
        width_blocks = num_table_blocks[hi - 1]
        length = width_blocks * block_size
        tables = torch.zeros(len(members), width_blocks, dtype=torch.long)  # [n, blocks]
        for r, i in enumerate(members):
            used = num_table_blocks[lo + r]
            tables[r, :used] = torch.tensor(block_tables[i][:used], dtype=torch.long)
        sizes = torch.tensor([context_lens[i] for i in members])
        padding = None
        if bool((sizes != length).any()):
            padding = (torch.arange(length)[None, :] >= sizes[:, None])[None, :, None, :]  # [1, n, 1, L]
        group_rows = [rows[i] for i in members]
        in_order = group_rows == list(range(group_rows[0], group_rows[0] + len(group_rows)))
        groups.append(DecodeGroup(torch.tensor(group_rows, dtype=torch.long), length, padding, start,
                                  group_rows[0] if in_order else None, sizes))
        index.append((heads + tables[None]).reshape(-1))
        start += num_kv_heads * len(members) * length
    return groups, torch.cat(index)


@dataclass
class BatchSplit:
    """A scheduled batch as the torch and cpu backends read it: prefill spans, and the decode rows
    (one new token each) with their block tables and context lengths."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    prefills: list[PrefillSpan]
    decode_rows: list[int]
    decode_tables: list[Sequence[int]]
    decode_lens: list[int]
    # (least, greatest) slot of slot_mapping when every row decodes (from the ints, no tensor op), else None
    slot_bounds: tuple[int, int] | None = None


def split_batch(scheduled: Sequence[ScheduledRequest], block_tables: Sequence[Sequence[int]],
                block_size: int) -> BatchSplit:
    """Slots of every row; a request computing several tokens becomes a prefill span over its whole
    context, one computing a single token a decode row. A decode row's slot is computed without
    tensors (`cache_slot`), consecutive ones gathered into one tensor: `cache_slots`' seven tensor ops
    per row were 30% of ModelRunner.prepare's time at batch 1 (cProfile, bf16 SmolLM2)."""
    pieces, pending, prefills, decode_rows, decode_tables, decode_lens = [], [], [], [], [], []
    row = 0
    for item, table in zip(scheduled, block_tables):
        if item.num_new_tokens == 1:
            pending.append(cache_slot(table, item.start, block_size))
            decode_rows.append(row)
            decode_tables.append(table)
            decode_lens.append(item.end)
        else:
            if pending:
                pieces.append(torch.tensor(pending, dtype=torch.long))
                pending = []
            context = cache_slots(table, 0, item.end, block_size)  # [end]
            pieces.append(context[item.start:])
            prefills.append(prefill_span(row, item.start, context))
        row += item.num_new_tokens
    bounds = (min(pending), max(pending)) if pending and not pieces else None
    if pending or not pieces:
        pieces.append(torch.tensor(pending, dtype=torch.long))
    slot_mapping = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return BatchSplit(slot_mapping, prefills, decode_rows, decode_tables, decode_lens, bounds)


class TorchAttentionBackend(AttentionBackend[TorchAttentionMetadata]):
    """The CPU default: SDPA per prefill span, decode rows as batched matmuls in length groups."""

    name = "torch"

    def build_metadata(self, scheduled: Sequence[ScheduledRequest], block_tables: Sequence[Sequence[int]],
                       cache: KVCache) -> TorchAttentionMetadata:
        batch = split_batch(scheduled, block_tables, cache.block_size)
        slots = batch.slot_mapping
        meta = TorchAttentionMetadata(slot_mapping=slots, write_index=cache.write_index(slots), prefills=batch.prefills)
        if batch.decode_rows:
            meta.block_size = cache.block_size
            meta.decode_groups, meta.decode_index = plan_decode(
                batch.decode_rows, batch.decode_tables, batch.decode_lens, cache.block_size, cache.num_kv_heads,
                cache.num_blocks, decode_group_cap(cache.head_dim, cache.dtype))
        return meta

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TorchAttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        return paged_attention(query, k_cache, v_cache, meta, scale, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: TorchAttentionMetadata, scale: float, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """Attention of `query` [num_tokens, heads, head_dim] over the slot-indexed caches.

    `k_cache`/`v_cache` are head-major [kv_heads, slots, head_dim] (already holding this step's
    K/V). Grouped-query heads share KV as in transformers' `repeat_kv` (head h reads kv head
    h // (heads / kv_heads)). `sliding_window` / `logits_soft_cap` as `AttentionBackend.forward`
    states them. Returns [num_tokens, heads, head_dim].

    Raises:
        ValueError: sliding_window < 1 or logits_soft_cap <= 0.
    """
    check_attention_options(sliding_window, logits_soft_cap)
    out = torch.empty_like(query)
    prefill_attention(query, k_cache, v_cache, meta.prefills, scale, out, sliding_window, logits_soft_cap)
    if meta.decode_groups:
        decode_attention(query, k_cache, v_cache, meta, query.shape[1] // k_cache.shape[0], scale, out, sliding_window,
                logits_soft_cap)
    return out


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      prefills: list[PrefillSpan], scale: float, out: torch.Tensor,
                      sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
    """The prefill spans' rows of `out` [num_tokens, heads, head_dim]: SDPA over each span's context
    (`windowed_prefill` with a sliding window or a soft cap)."""
    num_rep = query.shape[1] // k_cache.shape[0]
    for span in prefills:
        if sliding_window is not None or logits_soft_cap is not None:
            windowed_prefill(query, k_cache, v_cache, span, scale, out, sliding_window, logits_soft_cap)
            continue
        # 4-D inputs with enable_gqa: SDPA's CPU flash kernel (3-D inputs, or K/V repeated per
        # head, fall back to the slower math path)
        q = query[span.token_start:span.token_end].transpose(0, 1)[None]  # [1, heads, q_len, head_dim]
        k = k_cache.index_select(1, span.context_slots)[None].to(query.dtype)  # [1, kv_heads, ctx, head_dim]
        v = v_cache.index_select(1, span.context_slots)[None].to(query.dtype)  # (a bfloat16 cache widened)
        if span.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=num_rep > 1)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scale, enable_gqa=num_rep > 1)
        out[span.token_start:span.token_end] = o[0].transpose(0, 1)


def windowed_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: PrefillSpan,
                     scale: float, out: torch.Tensor, sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """One span's rows of `out` with a sliding window and/or a soft cap. Only positions from the first
    query's window on are gathered (earlier blocks may be freed):

        positions  0 ....... kv_start ....... num_computed ....... context_len
                             |<- window of the first query ->|<- query rows ->|
        row at position p sees kv_start <= kv <= p with kv > p - sliding_window

    Without a cap this is SDPA with a boolean mask; with one, the explicit path (SDPA has no cap):
    scores in float32 at least, capped, masked, softmaxed.
    """
    num_rep = query.shape[1] // k_cache.shape[0]
    context_len = int(span.context_slots.numel())
    kv_start = 0 if sliding_window is None else max(0, span.num_computed - sliding_window + 1)
    slots = span.context_slots[kv_start:]
    query_pos = torch.arange(span.num_computed, context_len)[:, None]  # [q_len, 1]
    kv_pos = torch.arange(kv_start, context_len)[None, :]              # [1, ctx]
    mask = kv_pos <= query_pos                                          # [q_len, ctx]: True attends
    if sliding_window is not None:
        mask &= kv_pos > query_pos - sliding_window
    q = query[span.token_start:span.token_end].transpose(0, 1)[None]  # [1, heads, q_len, head_dim]
    k = k_cache.index_select(1, slots)[None].to(query.dtype)           # [1, kv_heads, ctx, head_dim]
    v = v_cache.index_select(1, slots)[None].to(query.dtype)
    if logits_soft_cap is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_rep > 1)[0]
    else:
        kv_heads, q_len, head_dim = k.shape[1], q.shape[2], q.shape[3]
        q = q.reshape(kv_heads, num_rep * q_len, head_dim)  # heads of one kv head are consecutive
        scores = capped_scores(q, k[0], scale, logits_soft_cap).view(kv_heads, num_rep, q_len, -1)
        scores.masked_fill_(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1).view(kv_heads, num_rep * q_len, -1)
        o = torch.matmul(weights, v[0].to(weights.dtype)).view(-1, q_len, head_dim).to(query.dtype)  # [heads, q, d]
    out[span.token_start:span.token_end] = o.transpose(0, 1)


def capped_scores(q: torch.Tensor, k: torch.Tensor, scale: float, logits_soft_cap: float | None) -> torch.Tensor:
    """(q @ k^T) * scale [..., rows, ctx] in float32 at least (half precision upcast), then with a cap
    cap * tanh(scores / cap), as Gemma 2's eager attention; q [..., rows, d], k [..., ctx, d]."""
    if q.dtype in (torch.float16, torch.bfloat16):
        q, k = q.float(), k.float()
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    return scores


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TorchAttentionMetadata,
            num_rep: int, scale: float, out: torch.Tensor, sliding_window: int | None = None,
            logits_soft_cap: float | None = None) -> None:
    """Decode rows' attention into `out` (one token per row, groups from `plan_decode`).

    The `num_rep` query heads sharing a kv head become that kv head's query rows, so K/V are
    gathered once per kv head and never repeated; `index_select` over the flat head-major cache is
    a plain row copy (several times faster on CPU than advanced indexing). Scores are two batched
    matmuls and a softmax, in float32 at least (half-precision inputs are upcast): for these few query rows
    per (kv head, sequence) that is ~2x faster on CPU than SDPA's flash kernel with a mask. With a
    sliding window a group gathers no block that lies before every row's window; a position before
    its own row's window (a released block's placeholder included) is masked by fill. With a soft
    cap the scores are capped before the mask.
    """
    kv_heads, _, head_dim = k_cache.shape
    block_values = meta.block_size * head_dim
    k_blocks, v_blocks = k_cache.view(-1, block_values), v_cache.view(-1, block_values)
    for group in meta.decode_groups:
        n, length = group.rows.numel(), group.context_len
        size = kv_heads * n * length
        blocks = meta.decode_index[group.start // meta.block_size:(group.start + size) // meta.block_size]
        skip = 0  # leading blocks before every row's window: not gathered
        if sliding_window is not None:
            skip = max(0, int(group.context_lens.min()) - sliding_window) // meta.block_size
        if skip:
            blocks = blocks.view(kv_heads, n, -1)[:, :, skip:].reshape(-1)
            length -= skip * meta.block_size
        k = k_blocks.index_select(0, blocks).view(kv_heads, n, length, head_dim)
        v = v_blocks.index_select(0, blocks).view(kv_heads, n, length, head_dim)
        if group.first_row is None:
            q = query.index_select(0, group.rows)
        else:
            q = query[group.first_row:group.first_row + n]
        q = q.view(n, kv_heads, num_rep, head_dim).transpose(0, 1)                                    # [kv, n, rep, d]
        if q.dtype in (torch.float16, torch.bfloat16):  # scores and weights in float32 (no overflow)
            q = q.float()
        k, v = k.to(q.dtype), v.to(q.dtype)  # half precision upcast, or a bfloat16 cache under a float32 model
        scores = torch.matmul(q * scale, k.transpose(-1, -2))                                         # [kv, n, rep, L]
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        masked = group.masked(sliding_window)
        if masked is not None:
            scores.masked_fill_(masked[..., skip * meta.block_size:], float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v).to(query.dtype)                            # [kv, n, rep, d]
        o = o.transpose(0, 1).reshape(n, -1, head_dim)                                                # [n, heads, d]
        if group.first_row is None:
            out.index_copy_(0, group.rows, o)
        else:
            out[group.first_row:group.first_row + n] = o
