"""The C decode-attention kernel (attention_backend="cpu") against the torch path and a float64
reference on odd shapes: GQA ratios 1..4, head_dim 8..80 (not only powers of two), block sizes 1..32,
contexts of 1 position up to several blocks, decode rows scattered among prefill rows. Also: stale
NaN/inf in slots past a row's context never reach it, and a row's result does not depend on the
thread count or on the other rows of the step. The whole engine with this backend is checked against
transformers in test_smollm.py and test_conformance.py."""

import random
from types import SimpleNamespace

import pytest
import torch
from test_attention import decode_meta, reference, scattered

from services.decoder.attention import cpu_backend as cpu_attention
from services.decoder.attention import make_attention_backend
from services.decoder.attention.cpu_backend import CpuAttentionMetadata
from services.decoder.attention.torch_backend import paged_attention, prefill_span
from services.decoder.config import DecoderConfig
from services.decoder.engine_parts import resolve_backends
from services.decoder.kernels import native
from services.decoder.kv_cache import KVCache
from services.decoder.lora.registry import make_backend

# none; a window inside one block, across blocks; a cap; both (windows longer than a row read it whole)
WINDOW_AND_CAP = [{}, {"sliding_window": 3}, {"sliding_window": 20}, {"logits_soft_cap": 2.0},
                  {"sliding_window": 9, "logits_soft_cap": 0.7}]


def cpu_paged_attention(query, k_cache, v_cache, meta, scale, **options):
    """The cpu backend's attention (prefill rows and decode rows in their C kernels)."""
    return make_attention_backend("cpu").forward(query, k_cache, v_cache, meta, scale, **options)


def _case(num_heads, num_kv_heads, head_dim, block_size, lengths, seed=0, cache_dtype=torch.float32):
    """Caches (of `cache_dtype`; the query is float32), a query batch with one 5-token prefill chunk at
    rows 0..4 then the decode rows, and both backends' metadata for it."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 7
    cache = KVCache(1, num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
    k, v = cache.layer(0)
    k.normal_(), v.normal_()
    tables, slots = scattered(lengths, block_size, num_blocks, seed=seed)
    rows = [5 + 2 * i for i in range(len(lengths))]  # decode rows interleaved with unused rows
    num_tokens = rows[-1] + 2
    query = torch.randn(num_tokens, num_heads, head_dim)
    prefill_slots = torch.arange(20, 30)  # a prefill chunk: positions 5..9 of a 10-token sequence
    prefills = [prefill_span(0, 5, prefill_slots)]
    torch_meta = decode_meta(rows, tables, lengths, cache, num_tokens, prefills)
    cpu_meta = CpuAttentionMetadata(slot_mapping=torch.zeros(num_tokens, dtype=torch.long), prefills=prefills,
                                    block_size=block_size)
    cpu_meta.decode = cpu_attention.decode_metadata(rows, tables, lengths, block_size)
    cpu_meta.prefill = cpu_attention.CpuPrefillMetadata.of(prefills)
    return cache, query, rows, slots, torch_meta, cpu_meta


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (9, 3, 64, 16),   # SmolLM2's attention
    (4, 4, 8, 1),     # MHA, one-slot blocks
    (8, 2, 24, 4),    # GQA 4, head_dim not a power of two
    (6, 3, 80, 32),   # head_dim 80
    (2, 1, 16, 8),
    (4, 2, 12, 8),    # head_dim not a multiple of 8: the kernel's scalar loops
])
@pytest.mark.parametrize("options", WINDOW_AND_CAP, ids=str)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["f32-cache", "bf16-cache"])
def test_decode_rows_equal_torch_path_and_float64(num_heads, num_kv_heads, head_dim, block_size, options,
                                                  cache_dtype):
    """float32 queries over a float32 cache, and over a bfloat16 one (--kv-cache-dtype bfloat16: the
    reference reads the cache's bf16 values widened, so only summation order separates them)."""
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 37, 150]
    cache, query, rows, slots, torch_meta, cpu_meta = _case(num_heads, num_kv_heads, head_dim, block_size, lengths,
                                                            cache_dtype=cache_dtype)
    k, v = cache.layer(0)
    scale = head_dim ** -0.5
    expected = paged_attention(query, k, v, torch_meta, scale, **options)
    got = cpu_paged_attention(query, k, v, cpu_meta, scale, **options)
    torch.testing.assert_close(got[:5], expected[:5], atol=2e-6, rtol=0)  # prefill rows: the C kernel vs SDPA
    for row, row_slots in zip(rows, slots):
        torch.testing.assert_close(got[row], expected[row], atol=2e-6, rtol=0)
        torch.testing.assert_close(got[row].double(), reference(query[row], k, v, row_slots, scale, **options),
                                   atol=2e-6, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 12])  # the AVX2 loops, the scalar loops
def test_sharp_rows_whose_exponents_underflow(head_dim):
    """Scores hundreds apart: most exponents are below -87, where exp is subnormal or zero and
    the kernel takes -87 instead (those weights stay under 2^-125); the outputs must not move. Small
    integer q and k and a power-of-two scale make every score exact in float32, so only the
    exponentials' rounding separates the kernel from float64."""
    lengths = [1, 16, 37, 150, 300]
    cache, query, rows, slots, torch_meta, cpu_meta = _case(6, 2, head_dim, 16, lengths, seed=5)
    k, v = cache.layer(0)
    generator = torch.Generator().manual_seed(5)
    k.copy_(torch.randint(-4, 5, k.shape, generator=generator))
    bound = 60 * (64 // head_dim) ** 0.5  # scores' spread grows with head_dim: about the same for both
    query.copy_(torch.randint(-int(bound), int(bound) + 1, query.shape, generator=generator))
    scale = 0.125
    got = cpu_paged_attention(query, k, v, cpu_meta, scale)
    scores = query[rows[4]].view(2, 3, head_dim).double() * scale @ k[:, slots[4]].double().transpose(1, 2)
    assert ((scores - scores.amax(-1, keepdim=True)) < -87).double().mean() > 0.3  # the case this is about
    for row, row_slots in zip(rows, slots):
        torch.testing.assert_close(got[row].double(), reference(query[row], k, v, row_slots, scale),
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 12])
def test_rows_whose_scores_are_all_far_below_zero(head_dim):
    """Every score near -250 (a shared direction in K opposed by q): the softmax must subtract the
    row's own max, not 0, or every exponent would sit at the -87 floor and the weights turn uniform."""
    lengths = [1, 16, 37, 150]
    cache, query, rows, slots, torch_meta, cpu_meta = _case(6, 2, head_dim, 16, lengths, seed=6)
    k, v = cache.layer(0)
    generator = torch.Generator().manual_seed(6)
    k.copy_(torch.randint(-2, 3, k.shape, generator=generator))
    query.copy_(torch.randint(-6, 7, query.shape, generator=generator))
    k[..., 0] = 10.0
    query[..., 0] = -200.0  # scores -250 +- ~20, exact in float32 (integers times 1/8)
    got = cpu_paged_attention(query, k, v, cpu_meta, 0.125)
    for row, row_slots in zip(rows, slots):
        torch.testing.assert_close(got[row].double(), reference(query[row], k, v, row_slots, 0.125),
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 12])
def test_a_nan_query_or_an_inf_key_gives_nan_rows_as_torch(head_dim):
    """Non-finite inputs are not hidden: a NaN query row, or a K position holding inf (written as it
    came), makes that row's output NaN on both backends; the other rows are unaffected."""
    lengths = [5, 37, 150]
    cache, query, rows, slots, torch_meta, cpu_meta = _case(6, 2, head_dim, 16, lengths, seed=7)
    k, v = cache.layer(0)
    query[rows[0], 0, 0] = float("nan")
    k[0, slots[1][9], 3] = float("inf")
    scale = head_dim ** -0.5
    expected = paged_attention(query, k, v, torch_meta, scale)
    got = cpu_paged_attention(query, k, v, cpu_meta, scale)
    for row in rows:
        assert torch.equal(got[row].isnan(), expected[row].isnan()), row
    assert got[rows[0], 0].isnan().all() and got[rows[1]].isnan().any()  # the head with the NaN; the inf's group
    torch.testing.assert_close(got[rows[2]], expected[rows[2]], atol=2e-6, rtol=0)


SEED_BLOCK_0_FREE = 3


def test_stale_non_finite_slots_past_the_context_are_never_read():
    cache, query, rows, slots, _, cpu_meta = _case(9, 3, 64, 16, [5, 21, 40], seed=SEED_BLOCK_0_FREE)
    k, v = cache.layer(0)
    clean = cpu_paged_attention(query, k, v, cpu_meta, 0.125)
    tables = cpu_meta.decode.block_tables
    for i, n in enumerate([5, 21, 40]):  # poison every slot of the row's last block past its length
        last = (n - 1) // 16
        block, used = int(tables[i, last]), n - 16 * last
        k[:, block * 16 + used:(block + 1) * 16] = float("nan")
        v[:, block * 16 + used:(block + 1) * 16] = float("inf")
    used_blocks = {int(tables[i, j]) for i, n in enumerate([5, 21, 40]) for j in range(-(-n // 16))}
    assert 0 not in used_blocks  # block 0 only pads the tables in this seed's layout: poison it too
    k[:, 0:16], v[:, 0:16] = float("nan"), float("nan")
    got = cpu_paged_attention(query, k, v, cpu_meta, 0.125)
    for row in rows:
        assert torch.isfinite(got[row]).all()
        torch.testing.assert_close(got[row], clean[row], atol=0, rtol=0)


def test_a_row_does_not_depend_on_thread_count_or_its_neighbours():
    lengths = [random.Random(i).randint(1, 300) for i in range(24)]
    cache, query, rows, _, _, cpu_meta = _case(9, 3, 64, 16, lengths, seed=5)
    k, v = cache.layer(0)
    both = cpu_paged_attention(query, k, v, cpu_meta, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_paged_attention(query, k, v, cpu_meta, 0.125)
    finally:
        torch.set_num_threads(threads)
    for row in rows:
        torch.testing.assert_close(one[row], both[row], atol=0, rtol=0)
    # row 3 alone in its step
    alone = CpuAttentionMetadata(slot_mapping=torch.zeros(query.shape[0], dtype=torch.long), block_size=16)
    table = cpu_meta.decode.block_tables[3].tolist()
    alone.decode = cpu_attention.decode_metadata([rows[3]], [table], [lengths[3]], 16)
    torch.testing.assert_close(cpu_paged_attention(query, k, v, alone, 0.125)[rows[3]], both[rows[3]], atol=0, rtol=0)


def test_bad_inputs_are_refused():
    cache, query, _, _, _, cpu_meta = _case(4, 2, 16, 4, [3, 9])
    k, v = cache.layer(0)
    out = torch.empty_like(query)
    with pytest.raises(ValueError, match="all float32, all bfloat16, or a float32 query over bfloat16 caches"):
        cpu_attention.paged_decode_attention(query.double(), k, v, cpu_meta.decode, 4, 0.25, out)
    with pytest.raises(ValueError, match="got query torch.bfloat16, caches torch.float32"):  # no bf16-over-f32
        cpu_attention.paged_decode_attention(query.bfloat16(), k, v, cpu_meta.decode, 4, 0.25, out.bfloat16())
    with pytest.raises(ValueError, match="caches torch.bfloat16/torch.float32"):  # K and V of one dtype
        cpu_attention.paged_decode_attention(query, k.bfloat16(), v, cpu_meta.decode, 4, 0.25, out)
    with pytest.raises(ValueError, match="contiguous query"):
        cpu_attention.paged_decode_attention(query.transpose(0, 1), k, v, cpu_meta.decode, 4, 0.25, out)
    with pytest.raises(ValueError, match="shapes do not fit"):  # the cache's head_dim differs
        cpu_attention.paged_decode_attention(query, k[..., :8].contiguous(), v[..., :8].contiguous(),
                                             cpu_meta.decode, 4, 0.25, out)
    with pytest.raises(ValueError, match="shapes do not fit"):  # tables narrower than the contexts
        cpu_attention.paged_decode_attention(query, k, v, cpu_meta.decode, 2, 0.25, out)
    m = cpu_meta.decode
    with pytest.raises(ValueError, match="max_context"):  # score buffers would be too small
        cpu_attention.CpuDecodeMetadata(m.rows, m.block_tables, m.context_lens, 4)
    with pytest.raises(ValueError, match="int32"):
        cpu_attention.CpuDecodeMetadata(m.rows, m.block_tables.long(), m.context_lens, m.max_context)


def test_config_refuses_other_dtypes_and_a_missing_compiler(tiny_llama, monkeypatch):
    for dtype in ("float16", "float64"):
        for backend in ("attention_backend", "lora_backend"):
            with pytest.raises(ValueError, match="computes float32 and bfloat16 only"):
                DecoderConfig(model_dir=str(tiny_llama), dtype=dtype, **{backend: "cpu"})
    assert DecoderConfig(model_dir=str(tiny_llama), attention_backend="cpu", lora_backend="cpu",
                         dtype="bfloat16").dtype == "bfloat16"
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(ValueError, match="need a C compiler"):
        make_attention_backend("cpu")
    monkeypatch.setenv("CC", "false")  # fails silently: the message still names the command
    with pytest.raises(ValueError, match="'false .*' exited with 1: \\(no output\\)"):
        make_backend("cpu")
    monkeypatch.setenv("CC", "true")  # "succeeds" without building anything
    with pytest.raises(ValueError, match="built but could not be loaded"):
        make_attention_backend("cpu")
    backends = resolve_backends(DecoderConfig(model_dir=str(tiny_llama)))  # auto falls back to torch, naming why
    assert (backends.attention, backends.lora, backends.linear, backends.pointwise) == ("torch", "torch", "torch", False)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16)], ids=["f32", "bf16", "f32-bf16-cache"])
@pytest.mark.parametrize("tokens", [0, 1, 7, 300])
def test_kv_write_equals_the_cache_write(dtype, cache_dtype, tokens):
    """The C KV write (the cpu backend's write_kv) stores what KVCache.write stores: k and v taken as
    column views of a fused projection, rounded to a bfloat16 cache as torch's `.to` rounds (ties to
    even; a float32 V past bfloat16's range stored as 0, as NaN and +-inf are), every other slot untouched."""
    torch.manual_seed(tokens)
    caches = [KVCache(2, 100, 4, 3, 8, cache_dtype) for _ in range(2)]
    for cache in caches:
        for t in cache.key + cache.value:
            t.copy_(torch.arange(t.numel()).view(t.shape).to(cache_dtype))  # what must stay where not written
    fused = torch.randn(tokens, (4 + 2 * 3) * 8).to(dtype)
    k, v = fused[:, 32:56].view(tokens, 3, 8), fused[:, 56:80].view(tokens, 3, 8)
    if tokens >= 7:
        v[2, 1, 3], v[4, 0, 0], v[5, 2, 7], k[6, 0, 1] = float("nan"), float("inf"), -float("inf"), float("nan")
        if dtype == torch.float32:  # finite in float32, inf once rounded to bfloat16; a tie rounded to even
            v[3, 0, 0], k[3, 1, 1], k[3, 1, 2] = 3.4e38, -3.4e38, 1 + 2 ** -8
    slots = torch.randperm(400)[:tokens]
    caches[0].write(1, caches[0].write_index(slots), k, v)
    cpu_attention.write_kv(k, v, slots, *caches[1].layer(1))
    bits = torch.int16 if cache_dtype == torch.bfloat16 else torch.int32
    for a, b in zip(caches[0].key + caches[0].value, caches[1].key + caches[1].value):
        if cache_dtype == dtype:
            assert torch.equal(a.view(bits), b.view(bits))  # bits, NaN included
        else:  # a NaN rounded stays NaN (torch's vectorized copy sets every bit of its payload, the kernel one)
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0).view(bits), b.nan_to_num(0).view(bits))
    if tokens >= 7 and cache_dtype != dtype:
        k_cache, v_cache = caches[1].layer(1)
        assert v_cache[0, slots[3], 0] == 0 and k_cache[1, slots[3], 1] == -float("inf")
        assert k_cache[1, slots[3], 2] == 1.0  # 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: to even


def test_kv_write_refusals_and_out_of_range_slots():
    cache = KVCache(1, 4, 4, 2, 8, torch.float32)
    k_cache, v_cache = cache.layer(0)
    key = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="all float32, all bfloat16, or float32 key/value into bfloat16 caches"):
        cpu_attention.write_kv(key.bfloat16(), key, torch.arange(3), k_cache, v_cache)
    with pytest.raises(ValueError, match="torch.bfloat16/torch.bfloat16 into torch.float32"):  # never widened
        cpu_attention.write_kv(key.bfloat16(), key.bfloat16(), torch.arange(3), k_cache, v_cache)
    with pytest.raises(ValueError, match="shapes do not fit"):
        cpu_attention.write_kv(key[:, :1], key[:, :1], torch.arange(3), k_cache, v_cache)
    with pytest.raises(ValueError, match="shapes do not fit"):
        cpu_attention.write_kv(key, key, torch.arange(3, dtype=torch.int32), k_cache, v_cache)
    # build_metadata checks the slots once per step, before any write: positions 4..6 of a request whose
    # second block id (9) lies past this cache's 4 blocks
    chunk = SimpleNamespace(num_new_tokens=3, start=4, end=7)
    with pytest.raises(ValueError, match="outside the cache's 16 slots"):
        make_attention_backend("cpu").build_metadata([chunk], [[0, 9]], cache)
