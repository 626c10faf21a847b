"""The torch paged attention over the head-major cache: decode length groups and prefill spans vs
a per-row float64 reference (scattered blocks, GQA, contexts from 1 to 600 positions)."""

import torch

from services.decoder.attention import GROUP_COST_POSITIONS, AttentionMetadata, paged_attention, plan_decode, prefill_span
from services.decoder.kv_cache import KVCache


def reference(q, k_cache, v_cache, slots, scale):
    """q [heads, d] (one query at the last position) over slots: float64 [heads, d]."""
    rep = q.shape[0] // k_cache.shape[0]
    k = k_cache[:, slots].double().repeat_interleave(rep, 0)  # [heads, ctx, d]
    v = v_cache[:, slots].double().repeat_interleave(rep, 0)
    weights = torch.softmax((k @ q.double()[:, :, None]).squeeze(-1) * scale, dim=-1)  # [heads, ctx]
    return (weights[:, :, None] * v).sum(1)


def test_decode_groups_and_prefill_equal_per_row_reference():
    torch.manual_seed(0)
    kv_heads, heads, head_dim, block_size, num_blocks = 2, 6, 16, 4, 700
    cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, torch.float32)
    k_cache, v_cache = cache.layer(0)
    k_cache.normal_(), v_cache.normal_()
    blocks = torch.randperm(num_blocks)
    lengths = [1, 2, 600, 17, 300, 5, 301, 450, 16, 3, 590, 64]
    contexts, used = [], 0
    for n in lengths:  # each row owns scattered blocks
        table = blocks[used:used + (n + block_size - 1) // block_size]
        used += table.numel()
        pos = torch.arange(n)
        contexts.append(table[pos // block_size] * block_size + pos % block_size)
    prompt = contexts.pop(2)                                      # row 0..9: a prefill of positions 590..599
    num_prefill = 10
    query = torch.randn(num_prefill + len(contexts), heads, head_dim)
    meta = AttentionMetadata(torch.zeros(query.shape[0], dtype=torch.long), prefills=[prefill_span(0, 590, prompt)])
    rows = list(range(num_prefill, query.shape[0]))
    meta.decode_rows = torch.tensor(rows)
    meta.decode_groups, meta.decode_index = plan_decode(rows, contexts, kv_heads, cache.num_slots)
    assert len(meta.decode_groups) > 1                            # short and long contexts are not padded together
    for group in meta.decode_groups:                              # no group pads more than it saves by merging
        sizes = [contexts[rows.index(r)].numel() for r in group.rows.tolist()]
        assert group.context_len == max(sizes) and (group.bias is None) == (min(sizes) == max(sizes))
    scale = head_dim ** -0.5
    out = paged_attention(query, k_cache, v_cache, meta, scale)
    for row, slots in zip(rows, contexts):
        torch.testing.assert_close(out[row].double(), reference(query[row], k_cache, v_cache, slots, scale),
                                   atol=1e-5, rtol=0)
    for i in range(num_prefill):                                  # causal: query i sees positions 0..590+i
        torch.testing.assert_close(out[i].double(), reference(query[i], k_cache, v_cache, prompt[:591 + i], scale),
                                   atol=1e-5, rtol=0)


def test_plan_decode_merges_when_a_split_saves_less_than_a_group_costs():
    slots = [torch.arange(n) for n in (100, 101, 102)]
    groups, index = plan_decode([0, 1, 2], slots, 3, 1000)
    assert len(groups) == 1 and groups[0].context_len == 102 and index.numel() == 3 * 3 * 102
    assert groups[0].first_row == 0                               # rows 0, 1, 2 in order: sliced, not gathered
    assert plan_decode([2, 0, 1], slots, 3, 1000)[0][0].first_row is None
    far = [torch.arange(n) for n in (10, 10 + 2 * GROUP_COST_POSITIONS)]
    groups, _ = plan_decode([4, 7], far, 1, 1000)
    assert [g.rows.tolist() for g in groups] == [[4], [7]] and all(g.bias is None for g in groups)


def test_decode_group_rows_sliced_in_order_or_gathered_out_of_order():
    torch.manual_seed(1)
    cache = KVCache(1, 64, 4, 2, 8, torch.float32)
    k_cache, v_cache = cache.layer(0)
    k_cache.normal_(), v_cache.normal_()
    query = torch.randn(4, 4, 8)
    for lengths, in_order in (((40, 40, 40, 40), True), ((40, 40, 39, 40), False)):  # sorted: rows 2, 0, 1, 3
        contexts = [torch.randperm(cache.num_slots)[:n] for n in lengths]
        meta = AttentionMetadata(torch.zeros(4, dtype=torch.long))
        meta.decode_rows = torch.arange(4)
        meta.decode_groups, meta.decode_index = plan_decode([0, 1, 2, 3], contexts, 2, cache.num_slots)
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
        contexts = [torch.arange(10), torch.arange(7)]           # padded group: -inf bias on row 1
        query = torch.full((2, 2, 128), 25.0, dtype=dtype)
        meta = AttentionMetadata(torch.zeros(2, dtype=torch.long))
        meta.decode_rows = torch.arange(2)
        meta.decode_groups, meta.decode_index = plan_decode([0, 1], contexts, 1, cache.num_slots)
        out = paged_attention(query, k_cache, v_cache, meta, 128 ** -0.5)
        assert out.dtype == dtype and torch.isfinite(out).all()
        for row, slots in enumerate(contexts):
            torch.testing.assert_close(out[row].double(), reference(query[row], k_cache, v_cache, slots, 128 ** -0.5),
                                       atol=tol, rtol=0)
