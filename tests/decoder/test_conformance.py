"""Greedy ids equal transformers' generate for 64 tokens and fp32 logits agree within 1e-4, for
each model family (Llama, Qwen2 with q/k/v bias, Qwen3 with q/k norm) in each regime: alone,
16 concurrent mixed-length requests, chunked prefill (16-token budget), a prefix-cache hit,
recompute preemption, and a request cancelled mid-stream. Every regime runs with both CPU attention
backends: the torch path and the C decode kernel (attention_backend="cpu")."""

import random

import pytest
from decoder_testing import (
    cancel_mid_stream,
    check_greedy,
    hf_greedy,
    hf_reference_batch,
    make_tiny_llama,
    run_requests,
)
from transformers import AutoModelForCausalLM

from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.types import GenerateInput, SamplingParams

NEW_TOKENS = 64
LENGTHS = [1, 3, 5, 9, 16, 17, 20, 24, 31, 33, 40, 47, 50, 57, 64, 70]
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(n)] for n in LENGTHS]
# shares the first 40 tokens (2 full 16-token blocks) with PROMPTS[-1], then diverges
PREFIX_PROMPT = PROMPTS[-1][:40] + [_rng.randrange(3, 49152) for _ in range(12)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    """(model dir, {prompt tuple: (ref ids, ref logits [n, vocab])}) for one tiny random family."""
    model_dir = make_tiny_llama(tmp_path_factory.mktemp(request.param), seed=3, family=request.param)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = PROMPTS + [PREFIX_PROMPT]
    refs = dict(zip(map(tuple, prompts), hf_reference_batch(model, prompts, NEW_TOKENS)))
    return model_dir, refs


def _engine(model_dir, attention_backend="torch", **overrides):
    options = dict(model_dir=str(model_dir), num_blocks=160, max_model_len=512, max_num_seqs=16,
                   attention_backend=attention_backend)
    options.update(overrides)
    return start_engine(DecoderConfig(**options))


def _greedy(prompt, request_id, max_tokens=NEW_TOKENS):
    return GenerateInput(SamplingParams(max_tokens=max_tokens), request_id=request_id, prompt_token_ids=tuple(prompt))


def _check(engine, refs, prompts, concurrent=True):
    """Run `prompts` (all at once, or one after another) and compare ids and logits with transformers."""
    return check_greedy(engine, refs, [_greedy(p, f"r{i}") for i, p in enumerate(prompts)], concurrent)


def test_alone(family, attention_backend):
    model_dir, refs = family
    engine = _engine(model_dir, attention_backend)
    try:
        _check(engine, refs, [PROMPTS[0], PROMPTS[-1]], concurrent=False)
    finally:
        engine.shutdown()


def test_sixteen_concurrent_mixed_lengths(family, attention_backend):
    model_dir, refs = family
    engine = _engine(model_dir, attention_backend)
    try:
        _check(engine, refs, PROMPTS)
        assert engine.stats().num_free_blocks == 160
    finally:
        engine.shutdown()


def test_chunked_prefill_every_prompt_chunked(family, attention_backend):
    model_dir, refs = family
    engine = _engine(model_dir, attention_backend, max_num_batched_tokens=16)
    chunks = []
    schedule = engine.parts.scheduler.schedule
    engine.parts.scheduler.schedule = lambda: (out := schedule(), chunks.extend(
        s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1))[0]
    try:
        _check(engine, refs, PROMPTS[-6:])  # prompts of 40..70 tokens: at least 3 chunks each
    finally:
        engine.shutdown()
    assert chunks and max(chunks) <= 16


def test_prefix_cache_hit(family, attention_backend):
    model_dir, refs = family
    engine = _engine(model_dir, attention_backend)
    try:
        first = _check(engine, refs, [PROMPTS[-1]])[0]
        assert first[2].usage.cached_prompt_tokens == 0
        second = _check(engine, refs, [PREFIX_PROMPT])[0]
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert second[2].usage.cached_prompt_tokens == 32  # two full 16-token blocks of the shared 40
    assert stats.prefix_cache_hits == 1 and stats.prefix_cache_hit_tokens == 32


def test_preemption_recompute(family, attention_backend):
    model_dir, refs = family
    # 24 blocks of 8 tokens cannot hold 16 requests of up to 70 + 64 tokens at once
    engine = _engine(model_dir, attention_backend, num_blocks=24, block_size=8)
    preempted = []
    original = engine.parts.scheduler._preempt
    engine.parts.scheduler._preempt = lambda r: (preempted.append(r.request_id), original(r))
    try:
        _check(engine, refs, PROMPTS)
        assert engine.stats().num_free_blocks == 24
    finally:
        engine.shutdown()
    assert preempted, "the pool was meant to force preemption"


def test_cancel_mid_stream_frees_blocks(family, attention_backend):
    model_dir, refs = family
    engine = _engine(model_dir, attention_backend)
    others = PROMPTS[8:12]

    try:
        held, results = cancel_mid_stream(engine, _greedy(PROMPTS[-1], "victim", max_tokens=400),
                                          [_greedy(p, f"o{i}") for i, p in enumerate(others)])
        assert held and held >= 5   # 70-token prompt + 3 tokens in 16-token blocks
        assert [ids for ids, _, _ in results] == [refs[tuple(p)][0] for p in others]
        stats = engine.stats()
        assert stats.num_free_blocks == 160 and stats.num_running == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overrides", [dict(tie_word_embeddings=True), dict(attention_bias=True, mlp_bias=True)])
def test_llama_variants_equal_transformers(tmp_path, overrides):
    model_dir = make_tiny_llama(tmp_path / "variant", seed=1, **overrides)
    prompts = PROMPTS[2:5]
    refs = [hf_greedy(model_dir, p, 24) for p in prompts]
    engine = _engine(model_dir)
    try:
        assert [ids for ids, _, _ in run_requests(engine, [_greedy(p, "v", 24) for p in prompts])] == refs
    finally:
        engine.shutdown()
