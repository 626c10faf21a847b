"""Triton paged attention vs the torch path; run in a subprocess with TRITON_INTERPRET=1 (Triton reads
it when kernels are defined). `python tests/decoder/attention_kernel_cases.py MODEL_DIR...` prints OK lines (one engine case per directory).
`backend_case` runs any registered backend from a scheduled batch (test_attention_backends.py)."""

import os
import sys

import torch

from services.decoder.attention import make_attention_backend
from services.decoder.attention.torch_backend import TorchAttentionMetadata, paged_attention, plan_decode, prefill_span
from services.decoder.kv_cache import KVCache
from services.decoder.request import Request
from services.decoder.scheduler import ScheduledRequest
from services.decoder.types import PromptInputs, SamplingParams


def kernel_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> float:
    """One causal prefill chunk (positions 5..9 of a 10-token sequence) and two decodes, scattered blocks."""
    from services.decoder.attention.triton_kernel import triton_paged_attention  # defines the kernel

    torch.manual_seed(num_heads * 100 + head_dim)
    num_blocks = 12
    k = torch.randn(num_kv_heads, num_blocks * block_size, head_dim)  # head-major, as KVCache
    v = torch.randn(num_kv_heads, num_blocks * block_size, head_dim)
    tables = [[7, 2, 9, 4], [3, 11], [0, 5, 8]]
    lengths = [10, 2 * block_size - 3, 3 * block_size]  # seq 0 prefills 5..9; 1 and 2 decode their last

    def slots(seq, n):
        pos = torch.arange(n)
        return torch.tensor(tables[seq])[pos // block_size] * block_size + pos % block_size

    query = torch.randn(7, num_heads, head_dim)
    meta = TorchAttentionMetadata(slot_mapping=torch.zeros(7, dtype=torch.long),
                                  prefills=[prefill_span(0, 5, slots(0, 10))])
    meta.block_size = block_size
    meta.decode_groups, meta.decode_index = plan_decode([5, 6], tables[1:], lengths[1:], block_size, num_kv_heads,
                                                        num_blocks)
    expected = paged_attention(query, k, v, meta, head_dim ** -0.5)
    padded = torch.zeros(3, 4, dtype=torch.int32)
    for row, t in enumerate(tables):
        padded[row, :len(t)] = torch.tensor(t, dtype=torch.int32)
    token_seq = torch.tensor([0] * 5 + [1, 2], dtype=torch.int32)
    context_lens = torch.tensor([6, 7, 8, 9, 10, lengths[1], lengths[2]], dtype=torch.int32)
    got = triton_paged_attention(query, k, v, padded, token_seq, context_lens, block_size, head_dim ** -0.5)
    return float((got - expected).abs().max())


def backend_case(name: str, num_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 24, block_size: int = 4,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None) -> float:
    """Backend `name` through its own metadata, from a scheduled batch: largest |difference| to a
    float64 per-row reference. The batch: a prefill chunk (positions 5..9 of 10), a decode at position
    2 * block_size - 4, a whole 7-token prompt, a decode at position 3 * block_size - 1; blocks scattered.
    With `sliding_window`, row p's reference sees positions max(0, p - window + 1)..p, and every slot
    before its request's first window holds K = NaN, V = 1e30 (a freed block reused elsewhere: never
    read, or masked by a fill, not a bias); with `logits_soft_cap`, scores are capped by tanh.
    `cache_dtype` (default `dtype`): bfloat16 under a float32 `dtype` is --kv-cache-dtype bfloat16; the
    reference reads the cache's values, so this step's K/V count as rounded."""
    torch.manual_seed(7)
    tables = [[7, 2, 9, 4], [3, 11], [6, 10], [0, 5, 8]]
    # (positions computed before this step, positions computed in it) per request
    steps = [(5, 5), (2 * block_size - 4, 1), (0, 7), (3 * block_size - 1, 1)]
    cache_dtype = cache_dtype or dtype
    cache = KVCache(1, 12, block_size, num_kv_heads, head_dim, cache_dtype)
    k_cache, v_cache = cache.layer(0)
    k_cache.normal_(), v_cache.normal_()
    if sliding_window is not None:
        for (computed, _), table in zip(steps, tables):
            stale = torch.arange(max(0, computed - sliding_window + 1))
            slots = torch.tensor(table)[stale // block_size] * block_size + stale % block_size
            k_cache[:, slots], v_cache[:, slots] = float("nan"), 1e30
    scheduled = []
    for i, (computed, new) in enumerate(steps):
        request = Request(f"r{i}", f"r{i}", PromptInputs(list(range(computed + new))), SamplingParams(max_tokens=1))
        request.num_computed_tokens = computed
        scheduled.append(ScheduledRequest(request, new))
    num_tokens = sum(new for _, new in steps)
    query = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    backend = make_attention_backend(name)
    meta = backend.build_metadata(scheduled, tables, cache)
    backend.write_kv(cache, 0, key, value, meta)
    out = backend.forward(query, k_cache, v_cache, meta, head_dim ** -0.5, sliding_window=sliding_window,
                          logits_soft_cap=logits_soft_cap)
    rep, row, err = num_heads // num_kv_heads, 0, 0.0
    for (computed, new), table in zip(steps, tables):
        for position in range(computed, computed + new):  # row `row` sees positions 0..position
            first = 0 if sliding_window is None else max(0, position - sliding_window + 1)
            pos = torch.arange(first, position + 1)
            slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
            k = k_cache[:, slots].double().repeat_interleave(rep, 0)  # [heads, ctx, d]
            v = v_cache[:, slots].double().repeat_interleave(rep, 0)
            scores = (k @ query[row].double()[:, :, None]).squeeze(-1) * head_dim ** -0.5  # [heads, ctx]
            if logits_soft_cap is not None:
                scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
            weights = torch.softmax(scores, dim=-1)
            expected = (weights[:, :, None] * v).sum(1)  # [heads, d]
            err = max(err, float((out[row].double() - expected).abs().max()))
            row += 1
    new_slots = torch.cat([torch.tensor(t)[torch.arange(c, c + n) // block_size] * block_size
                           + torch.arange(c, c + n) % block_size for (c, n), t in zip(steps, tables)])
    assert torch.equal(k_cache[:, new_slots], key.transpose(0, 1).to(cache_dtype)), \
        "this step's K is not where write_kv put it"
    return err


# sliding windows inside a block, across blocks, wider than every context; soft caps alone and with one
BACKEND_OPTIONS = [{}, {"sliding_window": 3}, {"sliding_window": 6}, {"sliding_window": 64},
                   {"logits_soft_cap": 1.5}, {"sliding_window": 5, "logits_soft_cap": 2.0}]


def engine_case(model_dir: str) -> None:
    """Greedy ids and logits of the whole engine, triton backend vs torch backend (chunked, batched)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from decoder_testing import capture_logits, run_requests

    from services.decoder.config import DecoderConfig
    from services.decoder.engine import start_engine
    from services.decoder.types import GenerateInput, SamplingParams

    prompts = [list(range(100, 120)), [5, 6, 7]]
    results = {}
    for backend in ("torch", "triton"):
        engine = start_engine(DecoderConfig(model_dir=model_dir, num_blocks=16, block_size=8, max_model_len=128,
                                            max_num_batched_tokens=12, attention_backend=backend))
        logits = capture_logits(engine)
        try:
            ids = [r[0] for r in run_requests(engine, [GenerateInput(SamplingParams(max_tokens=4), request_id=f"r{i}",
                                                                     prompt_token_ids=tuple(p))
                                                       for i, p in enumerate(prompts)])]
        finally:
            engine.shutdown()
        results[backend] = (ids, {k: torch.stack(v) for k, v in logits.items()})
    assert results["torch"][0] == results["triton"][0], results
    for key, rows in results["torch"][1].items():
        torch.testing.assert_close(results["triton"][1][key], rows, atol=1e-4, rtol=0)
    print("OK engine", results["triton"][0])


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    for case in [(4, 2, 16, 4), (4, 4, 16, 8), (6, 2, 24, 4)]:  # GQA, MHA, non-power-of-two head_dim
        err = kernel_case(*case)
        assert err < 1e-5, (case, err)
        print("OK kernel", case, err)
    for options in BACKEND_OPTIONS:
        for cache_dtype in (torch.float32, torch.bfloat16):  # a float32 model's cache, and --kv-cache-dtype bfloat16
            err = backend_case("triton", cache_dtype=cache_dtype, **options)
            assert err < 1e-5, (options, cache_dtype, err)
            print("OK backend triton", options, cache_dtype, err)
    for model_dir in sys.argv[1:]:
        engine_case(model_dir)
