"""Seeded sampling, stop strings / stop ids, max_tokens and abort on the tiny model."""

import asyncio

import pytest
import torch
from decoder_testing import run_requests

from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.sampler import make_generator
from services.decoder.types import GenerateInput, SamplingParams

PROMPT = (1, 5, 77, 300, 12)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=512))
    yield engine
    engine.shutdown()


def _req(prompt=PROMPT, **sampling):
    sampling.setdefault("max_tokens", 16)
    return GenerateInput(SamplingParams(**sampling), prompt_token_ids=tuple(prompt))


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine):
    seeded = dict(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = run_requests(engine, [_req(**seeded)])[0][0]
    again = run_requests(engine, [_req(**seeded)])[0][0]
    batch = run_requests(engine, [_req((7, 8, 9), temperature=1.0), _req(**seeded),
                                  _req(list(range(30, 60)), temperature=0.7, seed=5)])
    other = run_requests(engine, [_req(**{**seeded, "seed": 99})])[0][0]
    assert alone == again == batch[1][0]
    assert alone != other
    greedy = run_requests(engine, [_req()])[0][0]
    assert alone != greedy


def test_a_negative_seed_is_a_seed_taken_modulo_2_64_as_vllms(engine):
    """vLLM's OpenAI server takes any int64 seed and hands it to torch's generator, which reads a
    negative one modulo 2**64: seed -1 is honoured, and draws as 2**64 - 1 does."""
    draws = [torch.rand(4, generator=make_generator(seed)).tolist() for seed in (-1, 2**64 - 1, 0)]
    assert draws[0] == draws[1] != draws[2]
    seeded = dict(temperature=1.0, top_k=50, seed=-1)
    first, again = (run_requests(engine, [_req(**seeded)])[0][0] for _ in range(2))
    assert first == again and first != run_requests(engine, [_req(**{**seeded, "seed": 1})])[0][0]


def test_max_tokens_finishes_with_length(engine):
    ids, text, last = run_requests(engine, [_req(max_tokens=5)])[0]
    assert len(ids) == 5 and last.finish_reason == "length"
    assert last.usage.completion_tokens == 5 and last.usage.prompt_tokens == len(PROMPT)
    assert text == engine.parts.tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_truncates_text_and_stops(engine):
    full_ids, full_text, _ = run_requests(engine, [_req(max_tokens=24)])[0]
    stop = full_text[12:16]
    ids, text, last = run_requests(engine, [_req(max_tokens=24, stop=(stop,))])[0]
    assert last.finish_reason == "stop"
    assert text == full_text[:full_text.find(stop)]
    assert len(ids) < 24 and ids == full_ids[:len(ids)]


def test_stop_token_id_stops_after_that_token(engine):
    full_ids = run_requests(engine, [_req(max_tokens=24)])[0][0]
    ids, _, last = run_requests(engine, [_req(max_tokens=24, stop_token_ids=(full_ids[6],))])[0]
    assert ids == full_ids[:full_ids.index(full_ids[6]) + 1] and last.finish_reason == "stop"


def test_closing_the_stream_aborts_and_frees_blocks(engine):
    total = engine.parts.block_manager.num_blocks

    async def main():
        stream = engine.generate(_req(max_tokens=400))
        first = await stream.__anext__()
        assert first.token_ids and engine.stats().num_free_blocks < total
        await stream.aclose()  # what the servicer does when the RPC is cancelled
        for _ in range(200):
            stats = engine.stats()
            if stats.num_free_blocks == total and stats.num_running == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_cancelled_task_aborts_and_frees_blocks(engine):
    total = engine.parts.block_manager.num_blocks

    async def consume():
        async for _ in engine.generate(_req(max_tokens=400)):
            pass

    async def main():
        task = asyncio.create_task(consume())
        while engine.stats().num_running == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if engine.stats().num_free_blocks == total and engine.stats().num_running == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_the_callers_greedy_ids_serve_only_unchanged_scores():
    """sample() takes the fused logits call's argmax for greedy rows whose scores are the logits as
    they came (they are its argmax: taken as given here, a deliberately different id shows it was
    used); a row's logit_bias, allow-list or bad word changes the scores, and then the argmax is
    taken afresh over what the controls left, for every row of that step."""
    from services.decoder.sampler import SamplingRow, sample

    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0], [3.0, 0.0, 1.0, 2.0]])
    plain = SamplingRow(SamplingParams(temperature=0.0))
    assert [s.token_id for s in sample(logits, [plain, plain], greedy_ids=[2, 3])] == [2, 3]
    assert [s.token_id for s in sample(logits, [plain, plain])] == [1, 0]
    for controlled in (SamplingParams(temperature=0.0, logit_bias={3: 2.0}),
                       SamplingParams(temperature=0.0, allowed_token_ids=[0, 3]),
                       SamplingParams(temperature=0.0, bad_words_token_ids=((1,),))):
        got = sample(logits, [SamplingRow(controlled), plain], greedy_ids=[2, 3])
        assert [s.token_id for s in got] == [3, 0], controlled
