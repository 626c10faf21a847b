"""Penalties, logprobs with top alternatives and n choices sharing prefix blocks (tiny Llama)."""

import asyncio

import pytest
import torch
from decoder_testing import hf_reference
from transformers import AutoModelForCausalLM

from services.common.errors import InvalidArgument
from services.decoder.config import DecoderConfig
from services.decoder.convert import output_to_pb, sampling_from_pb
from services.decoder.engine import start_engine
from services.decoder.types import GenerateInput, SamplingParams
from tessera.v1 import decoder_pb2

PROMPT = tuple(range(300, 340))  # 40 tokens: 2 full 16-token blocks


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=512))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


async def _collect_all(engine, request):
    return [out async for out in engine.generate(request)]


def _run(engine, **sampling):
    sampling.setdefault("max_tokens", 16)
    return asyncio.run(_collect_all(engine, GenerateInput(SamplingParams(**sampling), prompt_token_ids=PROMPT)))


def _ids(outputs, index=0):
    return [t for o in outputs if o.index == index for t in o.token_ids]


def test_repetition_penalty_greedy_equals_transformers(engine, hf_model):
    # 0.3 < 1 favours prompt tokens: on a random model that visibly changes the greedy path
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                max_new_tokens=24, do_sample=False, repetition_penalty=0.3)[0, len(PROMPT):].tolist()
    plain = _ids(_run(engine, max_tokens=24))
    assert _ids(_run(engine, max_tokens=24, repetition_penalty=0.3)) == ref != plain


def _openai_reference(model, presence, frequency, num_new):
    """Greedy over logits - presence * [count > 0] - frequency * count (generated tokens), full recompute."""
    ids, out = list(PROMPT), []
    for _ in range(num_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        for token in set(out):
            logits[token] -= presence + frequency * out.count(token)
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def test_presence_and_frequency_penalties_follow_the_openai_formula(engine, hf_model):
    # negative values reward repeats: the random model never repeats within 16 tokens on its own
    ref = _openai_reference(hf_model, -1.5, -0.7, 16)
    ids = _ids(_run(engine, presence_penalty=-1.5, frequency_penalty=-0.7))
    plain = _ids(_run(engine))
    assert ids == ref
    assert len(set(ids)) < len(set(plain))  # the penalties changed the continuation


def test_logprobs_and_top_alternatives_equal_transformers(engine, hf_model):
    ref_ids, ref_logits = hf_reference(hf_model, list(PROMPT), 8)
    ref_logprobs = torch.log_softmax(ref_logits, dim=-1)
    outputs = _run(engine, max_tokens=8, top_logprobs=5)
    samples = [s for o in outputs for s in o.logprobs]
    assert [s.token_id for s in samples] == _ids(outputs) == ref_ids
    for step, s in enumerate(samples):
        assert s.logprob == pytest.approx(float(ref_logprobs[step, s.token_id]), abs=1e-4)
        values, top_ids = torch.topk(ref_logprobs[step], 5)
        assert [t for t, _ in s.top] == top_ids.tolist()
        assert [lp for _, lp in s.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert s.top[0][0] == s.token_id  # greedy picks the most likely
    pb = output_to_pb(outputs[-1])
    assert pb.logprobs[0].token_id == samples[-1].token_id and len(pb.logprobs[0].top) == 5
    assert not _run(engine, max_tokens=2)[0].logprobs  # not requested: not computed


def test_n_choices_share_prefix_blocks_and_reproduce_seeds(engine):
    before = engine.stats()
    seeded = dict(temperature=1.0, seed=7, max_tokens=12)
    outputs = _run(engine, n=3, **seeded)
    after = engine.stats()
    finals = {o.index: o for o in outputs if o.finish_reason}
    assert sorted(finals) == [0, 1, 2]
    # choices 1 and 2 reuse choice 0's two full prompt blocks
    assert [finals[i].usage.cached_prompt_tokens for i in (1, 2)] == [32, 32]
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 2
    choices = [_ids(outputs, i) for i in range(3)]
    assert len({tuple(c) for c in choices}) == 3
    for i in range(3):  # choice i draws from seed + i, exactly as a single request with that seed
        assert _ids(_run(engine, **{**seeded, "seed": 7 + i})) == choices[i]
    assert engine.stats().num_free_blocks == 64


def test_sampling_extras_validation_and_pb():
    with pytest.raises(InvalidArgument, match="n must be in"):
        SamplingParams(max_tokens=4, n=17)
    with pytest.raises(InvalidArgument, match="top_logprobs must be in"):
        SamplingParams(max_tokens=4, top_logprobs=21)
    with pytest.raises(InvalidArgument, match="presence_penalty must be in"):
        SamplingParams(max_tokens=4, presence_penalty=3)
    params = sampling_from_pb(decoder_pb2.SamplingParams(max_tokens=4, n=2, top_logprobs=3, repetition_penalty=0,
                                                         frequency_penalty=0.5))
    assert (params.n, params.logprobs, params.top_logprobs, params.repetition_penalty, params.frequency_penalty) == \
        (2, True, 3, 1.0, 0.5)
