"""Scaled RoPE (linear, dynamic NTK, yarn, llama3) and the tied-head rule, against transformers 5.

Each rope type runs on a tiny 2-layer Llama with head_dim 64, max_position_embeddings 256 and
original_max_position_embeddings 64 (plus a Qwen3 with yarn), with prompts past 64 tokens: greedy
ids for 64 new tokens equal transformers' generate and fp32 logits agree within 1e-4, alone, several
concurrent, in chunked prefill (32-token chunks, so a chunk boundary falls at position 64), after a
prefix-cache hit that covers positions past 64, and after recompute preemption. longrope outside
Phi-3 (tests/decoder/test_phi3.py serves it there), unknown types and a partial rotary factor are
refused in one line naming them.
"""

import json
import logging
import random

import pytest
import torch
from decoder_testing import check_greedy, hf_reference, hf_reference_batch, make_tiny_llama
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from services.common.checkpoint import check_decoder_dir
from services.common.errors import InvalidArgument
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.models import load_model
from services.decoder.types import GenerateInput, SamplingParams

NEW_TOKENS = 64
ORIGINAL = 64  # original_max_position_embeddings: every prompt but the first crosses it
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 49152) for _ in range(n)] for n in (5, 40, 70, 90, 100)]
# shares its first 80 tokens (5 full 16-token blocks, past position 64) with PROMPTS[-1]
PREFIX_PROMPT = PROMPTS[-1][:80] + [_rng.randrange(3, 49152) for _ in range(12)]

CASES = {
    "llama-linear": ("llama", dict(rope_type="linear", factor=4.0)),
    "llama-dynamic": ("llama", dict(rope_type="dynamic", factor=2.0)),
    "llama-yarn": ("llama", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL)),
    "llama-llama3": ("llama", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=ORIGINAL)),
    "qwen3-yarn": ("qwen3", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL)),
}


def _tiny(path, family="llama", seed=5, **overrides):
    """A 2-layer model of `family` with head_dim 64 (2 query heads, 1 key-value head)."""
    options = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   max_position_embeddings=256)
    options.update(overrides)
    return make_tiny_llama(path, seed=seed, family=family, **options)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(model dir, {prompt tuple: (ref ids, ref logits [n, vocab])}) for one rope type."""
    family, rope = CASES[request.param]
    model_dir = _tiny(tmp_path_factory.mktemp(request.param), family, rope_parameters=dict(rope_theta=10000.0, **rope))
    assert json.loads((model_dir / "config.json").read_text())["rope_parameters"]["rope_type"] == rope["rope_type"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = PROMPTS + [PREFIX_PROMPT]
    refs = dict(zip(map(tuple, prompts), hf_reference_batch(model, prompts, NEW_TOKENS)))
    return model_dir, refs


def _engine(model_dir, **overrides):
    options = dict(model_dir=str(model_dir), num_blocks=80, max_model_len=256, max_num_seqs=8)
    options.update(overrides)
    return start_engine(DecoderConfig(**options))


def _check(engine, refs, prompts, concurrent=True):
    requests = [GenerateInput(SamplingParams(max_tokens=NEW_TOKENS), request_id=f"r{i}", prompt_token_ids=tuple(p))
                for i, p in enumerate(prompts)]
    return check_greedy(engine, refs, requests, concurrent)


def test_alone(case):
    model_dir, refs = case
    engine = _engine(model_dir)
    try:
        _check(engine, refs, [PROMPTS[-1]], concurrent=False)
    finally:
        engine.shutdown()


def test_concurrent(case):
    model_dir, refs = case
    engine = _engine(model_dir)
    try:
        _check(engine, refs, PROMPTS)
        assert engine.stats().num_free_blocks == 80
    finally:
        engine.shutdown()


def test_chunked_prefill_across_original_length(case):
    model_dir, refs = case
    engine = _engine(model_dir, max_num_batched_tokens=32)
    chunks = []
    schedule = engine.parts.scheduler.schedule
    engine.parts.scheduler.schedule = lambda: (out := schedule(), chunks.extend(
        (s.start, s.num_new_tokens) for s in out.scheduled if s.num_new_tokens > 1))[0]
    try:
        _check(engine, refs, PROMPTS[-2:])
    finally:
        engine.shutdown()
    assert any(start < ORIGINAL < start + n for start, n in chunks) or any(start == ORIGINAL for start, _ in chunks)
    assert max(n for _, n in chunks) <= 32


def test_prefix_cache_hit_past_original_length(case):
    model_dir, refs = case
    engine = _engine(model_dir)
    try:
        _check(engine, refs, [PROMPTS[-1]])
        second = _check(engine, refs, [PREFIX_PROMPT])[0]
    finally:
        engine.shutdown()
    assert second[2].usage.cached_prompt_tokens == 80


def test_preemption_recompute(case):
    model_dir, refs = case
    # 28 blocks of 8 tokens cannot hold 5 requests of up to 100 + 64 tokens at once
    engine = _engine(model_dir, num_blocks=28, block_size=8)
    preempted = []
    original = engine.parts.scheduler._preempt
    engine.parts.scheduler._preempt = lambda r: (preempted.append(r.request_id), original(r))
    try:
        _check(engine, refs, PROMPTS)
        assert engine.stats().num_free_blocks == 28
    finally:
        engine.shutdown()
    assert preempted, "the pool was meant to force preemption"


def test_legacy_rope_scaling_field_reads_as_transformers(tmp_path):
    """A transformers-4 config.json (rope_scaling with the legacy `type`, top-level rope_theta, no
    rope_parameters) gives transformers' frequencies, and they differ from default RoPE."""
    model_dir = _tiny(tmp_path / "legacy")
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=20000.0, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    (model_dir / "config.json").write_text(json.dumps(config))
    expected = AutoModelForCausalLM.from_pretrained(model_dir).model.rotary_emb.inv_freq
    rotary = load_model(model_dir, torch.float32).rotary
    assert torch.equal(rotary.inv_freq, expected)
    assert not torch.equal(rotary.inv_freq, 1.0 / 20000.0 ** (torch.arange(0, 64, 2).float() / 64))


def _with_head(model_dir, head):
    """Rewrite model.safetensors with lm_head.weight = head(embeddings), or without it for None."""
    state = load_file(model_dir / "model.safetensors")
    state.pop("lm_head.weight", None)
    if head is not None:
        state["lm_head.weight"] = head(state["model.embed_tokens.weight"]).contiguous()
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})


def test_tied_config_with_its_own_lm_head_keeps_it_as_transformers_does(tmp_path, caplog):
    model_dir = _tiny(tmp_path / "tied", tie_word_embeddings=True)
    _with_head(model_dir, lambda embeddings: torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(1))
               * 0.15)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # transformers keeps it
    refs = {tuple(p): hf_reference(model, p, NEW_TOKENS) for p in PROMPTS[1:3]}
    with caplog.at_level(logging.INFO, logger="services.decoder.model_llama"):
        engine = _engine(model_dir)
    try:
        _check(engine, refs, PROMPTS[1:3])
    finally:
        engine.shutdown()
    assert any("keeping the checkpoint's own lm_head" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("head", [lambda embeddings: embeddings.clone(), None], ids=["identical", "absent"])
def test_tied_config_with_the_same_or_no_lm_head_ties(tmp_path, head):
    model_dir = _tiny(tmp_path / "tied", tie_word_embeddings=True)
    _with_head(model_dir, head)
    model = load_model(model_dir, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("rope, message", [
    (dict(rope_type="longrope", short_factor=[1.0] * 32, long_factor=[2.0] * 32, original_max_position_embeddings=64),
     "RoPE scaling 'longrope' is not supported: it is served for Phi-3 (model_type 'phi3') only"),
    (dict(rope_type="ntk-by-parts", factor=2.0), "RoPE scaling 'ntk-by-parts' is not supported: the served types "
                                                 "are default, mrope, linear, dynamic, yarn, llama3"),
    (dict(rope_type="linear", factor=2.0, partial_rotary_factor=0.5),
     "partial_rotary_factor 0.5 is not supported: transformers' Llama, Qwen2 and Qwen3 rotate the whole head"),
])
def test_unserved_rope_is_refused_in_one_line(tmp_path, rope, message):
    model_dir = _tiny(tmp_path / "refused")
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"] = dict(rope_theta=10000.0, **rope)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        load_model(model_dir, torch.float32)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    if "partial" not in message:  # `tessera up` refuses the type before any service starts
        with pytest.raises(InvalidArgument, match=message.split(":")[0]):
            check_decoder_dir(model_dir)
