"""Greedy ids equal transformers' generate: alone, batched, chunked, preempted, tied, biased."""

import pytest

from conftest import hf_greedy, make_tiny_llama, run_requests
from services.decoder.config import DecoderConfig
from services.decoder.engine import LLMEngine
from services.decoder.inputs import GenerateInput, SamplingParams

PROMPTS = [
    [1, 5, 77, 300, 12],
    list(range(100, 140)),
    [9, 9, 9],
    list(range(2000, 2070, 3)),
    [42],
    list(range(500, 517)),
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def references(tiny_llama):
    return [hf_greedy(tiny_llama, p, NEW_TOKENS) for p in PROMPTS]


def _engine(model_dir, **overrides):
    options = dict(model_dir=str(model_dir), num_blocks=64, max_model_len=512)
    options.update(overrides)
    return LLMEngine(DecoderConfig(**options))


def _greedy(prompt):
    return GenerateInput(SamplingParams(max_tokens=NEW_TOKENS), prompt_token_ids=tuple(prompt))


def _run(engine, prompts):
    try:
        return [ids for ids, _, _ in run_requests(engine, [_greedy(p) for p in prompts])]
    finally:
        engine.shutdown()


def test_alone_equals_transformers(tiny_llama, references):
    engine = _engine(tiny_llama)
    for prompt, ref in zip(PROMPTS[:2], references[:2]):
        assert run_requests(engine, [_greedy(prompt)])[0][0] == ref
    engine.shutdown()


def test_six_concurrent_requests_equal_transformers(tiny_llama, references):
    assert _run(_engine(tiny_llama), PROMPTS) == references


def test_chunked_prefill_equals_transformers(tiny_llama, references):
    # 7-token budget: the 40- and 24-token prompts are split into several chunks
    engine = _engine(tiny_llama, max_num_batched_tokens=7)
    assert _run(engine, PROMPTS) == references


def test_preemption_recompute_equals_transformers(tiny_llama, references):
    # 8 blocks of 8 tokens cannot hold all six requests' 30-64 tokens: the latest are preempted
    engine = _engine(tiny_llama, num_blocks=8, block_size=8)
    preempted = []
    original = engine.scheduler._preempt
    engine.scheduler._preempt = lambda r: (preempted.append(r.request_id), original(r))
    assert _run(engine, PROMPTS) == references
    assert preempted, "the pool was meant to force preemption"
    assert engine.block_manager.num_free_blocks == 8


@pytest.mark.parametrize("overrides", [dict(tie_word_embeddings=True), dict(attention_bias=True, mlp_bias=True)])
def test_variants_equal_transformers(tmp_path, overrides):
    model_dir = make_tiny_llama(tmp_path / "variant", seed=1, **overrides)
    prompts = PROMPTS[:3]
    refs = [hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts]
    assert _run(_engine(model_dir), prompts) == refs
