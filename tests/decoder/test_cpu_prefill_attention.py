"""The C prefill-attention kernel (kernels/prefill_attention.c, the cpu backend's prefill spans) against
a float64 reference per query and against the torch path (SDPA), for each build this machine makes
(AVX-512 where it has it, an AVX2 + FMA host's, portable): GQA ratios 1..7, head_dim 12..128 (the
vector loops and the scalar ones), spans from 1 query row to several query tiles, starting at
position 0 or after earlier chunks (chunked prefill, prefix-cache hits), slots scattered over the
cache, sliding windows and soft caps. Also: non-finite inputs poison only the rows that see them, a
row does not depend on the other spans of the call nor on the thread count, and bad inputs are
refused. The whole engine on this backend is checked against transformers in test_smollm.py and
test_conformance.py."""

import pytest
import torch
from test_attention import reference, scattered
from test_cpu_attention import WINDOW_AND_CAP

from services.decoder.attention import cpu_backend
from services.decoder.attention.cpu_backend import CpuPrefillMetadata, paged_prefill_attention
from services.decoder.attention.torch_backend import prefill_attention, prefill_span
from services.decoder.kernels import native

KERNELS = {(torch.float32, torch.float32): "tessera_paged_prefill_attention_f32",
           (torch.bfloat16, torch.bfloat16): "tessera_paged_prefill_attention_bf16",
           (torch.float32, torch.bfloat16): "tessera_paged_prefill_attention_f32_bf16kv"}


@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def library(request):
    """The kernel library as this machine builds it, as an AVX2 + FMA host without AVX-512 builds it,
    and portable (no intrinsics)."""
    if request.param == "avx2":
        if not {"avx2", "fma"} <= native.cpu_flags():
            pytest.fail("this x86 test machine has no AVX2 + FMA: the avx2 build cannot run here")
        return native.build(march=native.AVX2_MARCH)
    return native.load() if request.param == "native" else native.build(portable=True)


def _run(library, query, k_cache, v_cache, meta, scale, sliding_window=None, logits_soft_cap=None, threads=2):
    out = torch.full_like(query, float("nan"))
    rc = getattr(library, KERNELS[query.dtype, k_cache.dtype])(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), meta.spans.data_ptr(), meta.spans.shape[0],
        meta.slots.data_ptr(), out.data_ptr(), query.shape[1], k_cache.shape[0], query.shape[2], k_cache.shape[1],
        scale, sliding_window or 0, logits_soft_cap or 0.0, threads)
    assert rc == 0
    return out


def _case(num_heads, num_kv_heads, head_dim, spans, dtype=torch.float32, cache_dtype=torch.float32, seed=0):
    """Caches and a query batch for `spans` [(query rows, num_computed)], each span's context on
    scattered blocks of 16; returns (query, k, v, prefill spans, each span's context slots)."""
    torch.manual_seed(seed)
    lengths = [rows + computed for rows, computed in spans]
    num_blocks = sum(-(-n // 16) for n in lengths) + 5
    k = torch.randn(num_kv_heads, num_blocks * 16, head_dim).to(cache_dtype)
    v = torch.randn(num_kv_heads, num_blocks * 16, head_dim).to(cache_dtype)
    _, slots = scattered(lengths, 16, num_blocks, seed=seed)
    query = torch.randn(sum(rows for rows, _ in spans) + 3, num_heads, head_dim).to(dtype)  # 3 rows of no span
    prefills, row = [], 1
    for (rows, computed), context in zip(spans, slots):
        prefills.append(prefill_span(row, computed, context))
        row += rows
    return query, k, v, prefills, slots


def _expected(query, k, v, prefills, slots, scale, **options):
    """float64 [rows, heads, head_dim] per query row of every span, from its position's context."""
    rows = {}
    for span, context in zip(prefills, slots):
        for i in range(span.token_end - span.token_start):
            rows[span.token_start + i] = reference(query[span.token_start + i].float(), k.float(), v.float(),
                                                   context[:span.num_computed + i + 1], scale, **options)
    return rows


SHAPES = [(9, 3, 64), (4, 4, 128), (8, 2, 24), (6, 3, 80), (7, 1, 32), (4, 2, 12)]  # 12: the scalar loops
SPANS = [(1, 0), (5, 0), (17, 0), (50, 3), (2, 40), (33, 16), (130, 0)]  # (query rows, num_computed)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", SHAPES, ids=str)
@pytest.mark.parametrize("options", WINDOW_AND_CAP, ids=str)
def test_spans_equal_float64_and_the_torch_path(library, num_heads, num_kv_heads, head_dim, options):
    query, k, v, prefills, slots = _case(num_heads, num_kv_heads, head_dim, SPANS)
    scale = head_dim ** -0.5
    got = _run(library, query, k, v, CpuPrefillMetadata.of(prefills), scale, **options)
    torch_path = torch.full_like(query, float("nan"))
    prefill_attention(query, k, v, prefills, scale, torch_path, options.get("sliding_window"),
                      options.get("logits_soft_cap"))
    for row, exact in _expected(query, k, v, prefills, slots, scale, **options).items():
        torch.testing.assert_close(got[row].double(), exact, atol=2e-6, rtol=0)
        torch.testing.assert_close(got[row], torch_path[row], atol=2e-6, rtol=0)
    assert got[0].isnan().all() and got[-2:].isnan().all(), "rows of no span were written"


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
                         ids=["bf16", "f32-over-bf16-cache"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 20, "logits_soft_cap": 2.0}], ids=str)
def test_bfloat16_spans_equal_float64(library, dtype, cache_dtype, options):
    """bf16 query, caches and output (float32 sums, the output rounded once), and a float32 query over
    bf16 caches (--kv-cache-dtype bfloat16): the reference reads the same bf16 values widened."""
    query, k, v, prefills, slots = _case(9, 3, 64, SPANS, dtype, cache_dtype)
    got = _run(library, query, k, v, CpuPrefillMetadata.of(prefills), 0.125, **options)
    for row, exact in _expected(query, k, v, prefills, slots, 0.125, **options).items():
        if dtype == torch.bfloat16:  # within the output's rounding: half a bf16 ulp, plus the sums' error
            assert ((got[row].double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5).all(), row
        else:
            torch.testing.assert_close(got[row].double(), exact, atol=2e-6, rtol=0)


def test_sharp_and_far_below_zero_scores(library):
    """Scores hundreds apart (exponents that underflow, a clamp at -87) and rows all far below zero: the
    online softmax's rescaling keeps the reference's weights, as close as SDPA's (scores of thousands
    carry float32 rounding into the exponent on both)."""
    query, k, v, prefills, slots = _case(4, 2, 64, [(40, 0), (20, 30)], seed=3)
    k[:, slots[0][7]] *= 40.0  # one position far above the rest for every later query
    query[5:9] *= 30.0
    k[:, slots[1]] -= 5.0
    for scale in (0.125, 4.0):
        got = _run(library, query, k, v, CpuPrefillMetadata.of(prefills), scale)
        sdpa = torch.empty_like(query)
        prefill_attention(query, k, v, prefills, scale, sdpa)
        for row, exact in _expected(query, k, v, prefills, slots, scale).items():
            error, sdpa_error = (got[row].double() - exact).abs().max(), (sdpa[row].double() - exact).abs().max()
            assert error <= 2 * sdpa_error + 2e-6, (row, scale, float(error), float(sdpa_error))


def test_non_finite_inputs_poison_only_the_rows_that_see_them(library):
    """A NaN in one query vector gives that head of that row NaN and nothing else; an inf in a key at
    position 10 gives +-inf scores to the queries of its kv head that see it: NaN rows where +inf (the
    softmax of inf), a zero weight where -inf, as the float64 reference (and torch) compute them."""
    query, k, v, prefills, slots = _case(4, 2, 16, [(20, 0), (20, 0)])
    query[3, 0, 5] = float("nan")              # span 0, row 2 (position 2), head 0
    k[1, slots[1][10], 3] = float("inf")       # span 1, position 10, kv head 1 (heads 2, 3)
    got = _run(library, query, k, v, CpuPrefillMetadata.of(prefills), 0.25)
    assert got[3, 0].isnan().all() and got[3, 1:].isfinite().all()
    poisoned = 0
    for row, exact in _expected(query, k, v, prefills, slots, 0.25).items():
        assert torch.equal(got[row].isnan(), exact.isnan()), row
        poisoned += int(exact.isnan().any())
        torch.testing.assert_close(got[row].double(), exact, atol=2e-6, rtol=0, equal_nan=True)
    assert poisoned > 1, "the case was meant to poison some rows of span 1"


def test_a_row_does_not_depend_on_other_spans_or_the_thread_count(library):
    query, k, v, prefills, _ = _case(9, 3, 64, SPANS)
    together = _run(library, query, k, v, CpuPrefillMetadata.of(prefills), 0.125)
    one_thread = _run(library, query, k, v, CpuPrefillMetadata.of(prefills), 0.125, threads=1)
    torch.testing.assert_close(together, one_thread, atol=0, rtol=0, equal_nan=True)
    for span in prefills:
        alone = _run(library, query, k, v, CpuPrefillMetadata.of([span]), 0.125)
        assert torch.equal(alone[span.token_start:span.token_end], together[span.token_start:span.token_end])


def test_the_backend_runs_prefill_and_decode_rows_in_one_step():
    """CpuAttentionBackend.forward: a prefill span beside decode rows (the kernel writes only its rows)."""
    from test_cpu_attention import _case as decode_case
    from test_cpu_attention import cpu_paged_attention

    cache, query, rows, slots, torch_meta, cpu_meta = decode_case(9, 3, 64, 16, [1, 16, 37])
    k, v = cache.layer(0)
    got = cpu_paged_attention(query, k, v, cpu_meta, 0.125)
    span = cpu_meta.prefills[0]
    for i in range(span.token_end - span.token_start):
        exact = reference(query[span.token_start + i], k, v, span.context_slots[:span.num_computed + i + 1], 0.125)
        torch.testing.assert_close(got[span.token_start + i].double(), exact, atol=2e-6, rtol=0)
    for row, row_slots in zip(rows, slots):
        torch.testing.assert_close(got[row].double(), reference(query[row], k, v, row_slots, 0.125), atol=2e-6, rtol=0)


def test_bad_inputs_are_refused():
    query, k, v, prefills, _ = _case(4, 2, 16, [(5, 0), (3, 4)])
    meta = CpuPrefillMetadata.of(prefills)
    out = torch.empty_like(query)
    with pytest.raises(ValueError, match="all float32, all bfloat16, or a float32 query over bfloat16 caches"):
        paged_prefill_attention(query.double(), k, v, meta, 0.25, out)
    with pytest.raises(ValueError, match="got query torch.bfloat16, caches torch.float32"):
        paged_prefill_attention(query.bfloat16(), k, v, meta, 0.25, out.bfloat16())
    with pytest.raises(ValueError, match="contiguous query"):
        paged_prefill_attention(query.transpose(0, 1), k, v, meta, 0.25, out)
    with pytest.raises(ValueError, match="shapes do not fit"):  # heads not a multiple of kv heads
        paged_prefill_attention(query[:, :3].contiguous(), k, v, meta, 0.25, out[:, :3].contiguous())
    with pytest.raises(ValueError, match="shapes do not fit"):  # the cache's head_dim differs
        paged_prefill_attention(query, k[..., :8].contiguous(), v[..., :8].contiguous(), meta, 0.25, out)
    with pytest.raises(ValueError, match="reach row 9, past the 4 query rows"):  # spans past the query rows
        paged_prefill_attention(query[:4].contiguous(), k, v, meta, 0.25, out[:4].contiguous())
    with pytest.raises(ValueError, match="outside their rows or the 10 slots"):  # contexts past the slots
        paged_prefill_attention(query, k, v, CpuPrefillMetadata(meta.spans, meta.slots[:10]), 0.25, out)
    with pytest.raises(ValueError, match="int64"):
        paged_prefill_attention(query, k, v, CpuPrefillMetadata(meta.spans.int(), meta.slots), 0.25, out)
    assert cpu_backend.CpuPrefillMetadata.of(prefills).spans.tolist() == [[1, 5, 0, 0], [6, 3, 4, 5]]
