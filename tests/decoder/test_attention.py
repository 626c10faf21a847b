"""The torch paged attention over the head-major cache: decode length groups (gathered by whole
blocks) and prefill spans vs a per-row float64 reference (scattered blocks, GQA, contexts 1..600)."""

import torch

from services.decoder.attention.torch_backend import (
    GROUP_COST_POSITIONS,
    TorchAttentionMetadata,
    paged_attention,
    plan_decode,
    prefill_span,
)
from services.decoder.kv_cache import KVCache


def reference(q, k_cache, v_cache, slots, scale, sliding_window=None, logits_soft_cap=None):
    """q [heads, d] (one query at the last position) over slots (the last `sliding_window` of them;
    scores capped by tanh with `logits_soft_cap`): float64 [heads, d]."""
    rep = q.shape[0] // k_cache.shape[0]
    if sliding_window is not None:
        slots = slots[-sliding_window:]
    k = k_cache[:, slots].double().repeat_interleave(rep, 0)  # [heads, ctx, d]
    v = v_cache[:, slots].double().repeat_interleave(rep, 0)
    scores = (k @ q.double()[:, :, None]).squeeze(-1) * scale  # [heads, ctx]
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    weights = torch.softmax(scores, dim=-1)
    return (weights[:, :, None] * v).sum(1)


def scattered(lengths, block_size, num_blocks, seed=0):
    """Block tables of rows with `lengths`, on distinct random blocks, and each row's slots."""
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, slots, used = [], [], 0
    for n in lengths:
        table = blocks[used:used + -(-n // block_size)]
        used += len(table)
        pos = torch.arange(n)
        tables.append(table)
        slots.append(torch.tensor(table)[pos // block_size] * block_size + pos % block_size)
    return tables, slots


def decode_meta(rows, tables, lengths, cache, num_tokens, prefills=(), **plan):
    meta = TorchAttentionMetadata(slot_mapping=torch.zeros(num_tokens, dtype=torch.long), prefills=list(prefills))
    meta.block_size = cache.block_size
    meta.decode_groups, meta.decode_index = plan_decode(rows, tables, lengths, cache.block_size,
                                                        cache.num_kv_heads, cache.num_blocks, **plan)
    return meta


def test_decode_groups_and_prefill_equal_per_row_reference():
    torch.manual_seed(0)
    kv_heads, heads, head_dim, block_size, num_blocks = 2, 6, 16, 4, 700
    cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, torch.float32)
    k_cache, v_cache = cache.layer(0)
    k_cache.normal_(), v_cache.normal_()
    lengths = [1, 2, 600, 17, 300, 5, 301, 450, 16, 3, 590, 64]
    tables, contexts = scattered(lengths, block_size, num_blocks)
    prompt = contexts.pop(2)                                      # rows 0..9: a prefill of positions 590..599
    del tables[2], lengths[2]
    num_prefill = 10
    query = torch.randn(num_prefill + len(contexts), heads, head_dim)
    rows = list(range(num_prefill, query.shape[0]))
    meta = decode_meta(rows, tables, lengths, cache, query.shape[0], [prefill_span(0, 590, prompt)])
    assert len(meta.decode_groups) > 1                            # short and long contexts are not padded together
    for group in meta.decode_groups:                              # padded to whole blocks of the longest row
        sizes = [lengths[rows.index(r)] for r in group.rows.tolist()]
        assert group.context_len == -(-max(sizes) // block_size) * block_size
        assert (group.padding is None) == all(size == group.context_len for size in sizes)
    scale = head_dim ** -0.5
    out = paged_attention(query, k_cache, v_cache, meta, scale)
    for row, slots in zip(rows, contexts):
        torch.testing.assert_close(out[row].double(), reference(query[row], k_cache, v_cache, slots, scale),
                                   atol=1e-5, rtol=0)
    for i in range(num_prefill):                                  # causal: query i sees positions 0..590+i
        torch.testing.assert_close(out[i].double(), reference(query[i], k_cache, v_cache, prompt[:591 + i], scale),
                                   atol=1e-5, rtol=0)


def test_plan_decode_merges_when_a_split_saves_less_than_a_group_costs():
    tables = [list(range(10))] * 3
    groups, index = plan_decode([0, 1, 2], tables, [100, 101, 102], 16, 3, 1000)
    assert len(groups) == 1 and groups[0].context_len == 112 and index.numel() == 3 * 3 * 7  # 7 blocks of 16
    assert groups[0].first_row == 0                               # rows 0, 1, 2 in order: sliced, not gathered
    assert plan_decode([2, 0, 1], tables, [100, 101, 102], 16, 3, 1000)[0][0].first_row is None
    far = [10 * 16, 10 * 16 + 2 * GROUP_COST_POSITIONS]
    groups, _ = plan_decode([4, 7], [list(range(60))] * 2, far, 16, 1, 1000)
    assert [g.rows.tolist() for g in groups] == [[4], [7]] and all(g.padding is None for g in groups)


def test_decode_group_rows_sliced_in_order_or_gathered_out_of_order():
    torch.manual_seed(1)
    cache = KVCache(1, 64, 4, 2, 8, torch.float32)
    k_cache, v_cache = cache.layer(0)
    k_cache.normal_(), v_cache.normal_()
    query = torch.randn(4, 4, 8)
    for lengths, in_order in (((40, 40, 40, 40), True), ((40, 40, 39, 40), False)):  # sorted: rows 2, 0, 1, 3
        tables, contexts = scattered(lengths, 4, 64, seed=len(lengths) + lengths[2])
        meta = decode_meta([0, 1, 2, 3], tables, list(lengths), cache, 4)
        assert len(meta.decode_groups) == 1 and (meta.decode_groups[0].first_row == 0) == in_order
        out = paged_attention(query, k_cache, v_cache, meta, 0.3)
        for row, slots in enumerate(contexts):
            torch.testing.assert_close(out[row].double(), reference(query[row], k_cache, v_cache, slots, 0.3),
                                       atol=1e-5, rtol=0)


def test_half_and_double_precision_decode_are_finite_and_close_to_float64():
    """Scores are computed in float32 (float64 stays float64): q.k of 25 x 25 x 128 = 80000 overflows float16."""
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)):
        cache = KVCache(1, 8, 4, 1, 128, dtype)
        k_cache, v_cache = cache.layer(0)
        k_cache.fill_(25.0)
        v_cache.copy_(torch.randn(v_cache.shape))
        k_cache[0, 3].fill_(24.0)                                 # one position scores lower
        tables, contexts = [[0, 1, 2], [0, 1]], [torch.arange(10), torch.arange(7)]  # padded: -inf bias
        query = torch.full((2, 2, 128), 25.0, dtype=dtype)
        out = paged_attention(query, k_cache, v_cache, decode_meta([0, 1], tables, [10, 7], cache, 2), 128 ** -0.5)
        assert out.dtype == dtype and torch.isfinite(out).all()
        for row, slots in enumerate(contexts):
            torch.testing.assert_close(out[row].double(), reference(query[row], k_cache, v_cache, slots, 128 ** -0.5),
                                       atol=tol, rtol=0)


def test_groups_capped_in_gathered_positions_and_still_exact():
    torch.manual_seed(2)
    cache = KVCache(1, 128, 4, 2, 8, torch.float32)
    k_cache, v_cache = cache.layer(0)
    k_cache.normal_(), v_cache.normal_()
    lengths = [40, 39, 40, 38, 40, 40, 37]                        # one length group of 40 (10 blocks)
    tables, contexts = scattered(lengths, 4, 128, seed=3)
    meta = decode_meta(list(range(7)), tables, lengths, cache, 7, max_group_positions=2 * 2 * 40)
    # at most 2 rows x 2 kv heads x 40 positions per group; rows stay sorted by length, then row
    assert [g.rows.tolist() for g in meta.decode_groups] == [[6, 3], [1, 0], [2, 4], [5]]
    assert [g.start for g in meta.decode_groups] == [0, 160, 320, 480]
    assert meta.decode_index.numel() == 7 * 2 * 10
    assert [g.first_row for g in meta.decode_groups] == [None, None, None, 5]
    query = torch.randn(7, 4, 8)
    out = paged_attention(query, k_cache, v_cache, meta, 0.3)
    for row, slots in enumerate(contexts):
        torch.testing.assert_close(out[row].double(), reference(query[row], k_cache, v_cache, slots, 0.3),
                                   atol=1e-5, rtol=0)
