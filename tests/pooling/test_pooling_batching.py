"""Dynamic batching: requests gathered into shared forwards, results independent of the company they keep."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.errors import ResourceExhausted
from services.pooling.batcher import group_by_length
from services.pooling.config import PoolingConfig
from services.pooling.engine import PoolingEngine

LONG = " ".join(f"Sentence number {i} talks about rivers, mountains and the weather in spring." for i in range(14))
SINGLES = ["A cat sat on the mat.", "Hello world", "Quantum computers use qubits.", "Paris is in France.",
           "I like green tea.", "The quick brown fox jumps over the lazy dog."]


def _service(minilm_model_config, minilm_loaded, **limits):
    config = PoolingConfig(models=[minilm_model_config], **limits)
    return PoolingEngine(config, models={minilm_loaded.name: minilm_loaded})


def _batcher(service):
    return service.models["all-minilm-l6-v2"].batcher


async def _concurrently(service, requests):
    return await asyncio.gather(*(service.embed(texts) for texts in requests), return_exceptions=True)


@pytest.fixture(scope="module")
def alone(minilm_model_config, minilm_loaded):
    """Each text embedded in a forward of its own (per-call lock mode, one request at a time)."""
    service = _service(minilm_model_config, minilm_loaded, dynamic_batching=False)
    vectors = {t: asyncio.run(service.embed([t])).vectors[0] for t in [*SINGLES, LONG]}
    assert all(rows == 1 for rows, _ in _batcher(service).batch_shapes)
    return vectors


def test_gathered_results_equal_results_alone(minilm_model_config, minilm_loaded, alone):
    service = _service(minilm_model_config, minilm_loaded, max_wait_ms=200)
    requests = [[t] for t in SINGLES] + [[LONG, SINGLES[0]]]
    results = asyncio.run(_concurrently(service, requests))
    shapes = list(_batcher(service).batch_shapes)
    assert sum(rows for rows, _ in shapes) == 8
    assert len(shapes) < len(requests) and max(rows for rows, _ in shapes) > 2  # requests really shared forwards
    for texts, result in zip(requests, results, strict=True):
        for text, vector in zip(texts, result.vectors, strict=True):
            torch.testing.assert_close(vector, alone[text], atol=1e-5, rtol=0)


def test_token_budget_bounds_every_forward(minilm_model_config, minilm_loaded, alone):
    long_tokens = len(minilm_loaded.tokenizer.encode_texts([LONG])[0])
    service = _service(minilm_model_config, minilm_loaded, max_wait_ms=200, max_batch_tokens=256)
    requests = [[LONG]] + [[t] for t in SINGLES] + [[LONG]]
    results = asyncio.run(_concurrently(service, requests))
    shapes = list(_batcher(service).batch_shapes)
    assert all(rows * length <= 256 for rows, length in shapes), shapes
    assert (1, long_tokens) in shapes  # the long text could not share its forward
    assert any(rows > 1 for rows, _ in shapes)  # the short ones could
    torch.testing.assert_close(results[0].vectors[0], alone[LONG], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[3].vectors[0], alone[SINGLES[2]], atol=1e-5, rtol=0)


def test_hold_time_zero_still_serves_everyone(minilm_model_config, minilm_loaded, alone):
    service = _service(minilm_model_config, minilm_loaded, max_wait_ms=0)
    results = asyncio.run(_concurrently(service, [[t] for t in SINGLES]))
    for text, result in zip(SINGLES, results, strict=True):
        torch.testing.assert_close(result.vectors[0], alone[text], atol=1e-5, rtol=0)


def test_past_the_queue_is_resource_exhausted(minilm_model_config, minilm_loaded, alone):
    # queue of 4 sequences; the first request (3) is held 300 ms, so the second (3) does not fit
    service = _service(minilm_model_config, minilm_loaded, max_batch_size=3, max_queue_size=4, max_wait_ms=300)
    results = asyncio.run(_concurrently(service, [SINGLES[:3], SINGLES[3:]]))
    refused = [r for r in results if isinstance(r, ResourceExhausted)]
    served = [r for r in results if not isinstance(r, BaseException)]
    assert len(refused) == 1 and len(served) == 1, results
    assert "3 sequences queued and this request adds 3; max_queue_size is 4" in str(refused[0])
    assert _batcher(service).num_waiting == 0
    # once the queue drains, the same request is accepted
    again = asyncio.run(service.embed(SINGLES[3:]))
    torch.testing.assert_close(again.vectors[0], alone[SINGLES[3]], atol=1e-5, rtol=0)


def test_per_call_lock_mode_runs_one_forward_per_request(minilm_model_config, minilm_loaded, alone):
    service = _service(minilm_model_config, minilm_loaded, dynamic_batching=False)
    requests = [[t] for t in SINGLES[:3]] + [[LONG, SINGLES[0]]]
    results = asyncio.run(_concurrently(service, requests))
    assert sorted(rows for rows, _ in _batcher(service).batch_shapes) == [1, 1, 1, 2]
    torch.testing.assert_close(results[3].vectors[1], alone[SINGLES[0]], atol=1e-5, rtol=0)


def test_cancelled_request_is_dropped_from_the_queue(minilm_model_config, minilm_loaded, alone):
    service = _service(minilm_model_config, minilm_loaded, max_wait_ms=300)

    async def run():
        doomed = asyncio.ensure_future(service.embed([SINGLES[0], SINGLES[1]]))
        kept = asyncio.ensure_future(service.embed([SINGLES[2]]))
        await asyncio.sleep(0.1)  # both queued, held
        doomed.cancel()
        return await kept

    result = asyncio.run(run())
    torch.testing.assert_close(result.vectors[0], alone[SINGLES[2]], atol=1e-5, rtol=0)
    assert list(_batcher(service).batch_shapes) == [(1, len(minilm_loaded.tokenizer.encode_texts([SINGLES[2]])[0]))]
    assert _batcher(service).num_waiting == 0


def test_embed_stream_answers_in_order(minilm_model_config, minilm_loaded, alone):
    from services.pooling.types import EmbedQuery

    service = _service(minilm_model_config, minilm_loaded, max_wait_ms=50)

    async def queries():
        for text in SINGLES:
            yield EmbedQuery(texts=(text,))

    async def run():
        return [r async for r in service.embed_stream(queries())]

    results = asyncio.run(run())
    assert len(results) == len(SINGLES)
    for text, result in zip(SINGLES, results, strict=True):
        torch.testing.assert_close(result.vectors[0], alone[text], atol=1e-5, rtol=0)
    assert max(rows for rows, _ in _batcher(service).batch_shapes) > 1  # the stream's texts shared forwards


def test_group_by_length_cuts_sorted_runs_at_the_budget_and_at_padding():
    assert group_by_length([12, 230, 8, 14, 240], 16384) == [[2, 0, 3], [1, 4]]
    assert group_by_length([100, 100, 100, 100, 100], 250) == [[0, 1], [2, 3], [4]]  # 3 x 100 > 250
    assert group_by_length([9, 9, 9], 16384) == [[0, 1, 2]]  # ties keep input order
    # 56 short and 8 long: padding the short ones to the long would waste 56 x 215 tokens
    assert group_by_length([15] * 56 + [230] * 8, 16384) == [list(range(56)), list(range(56, 64))]


def test_mixed_lengths_run_grouped_and_answer_in_the_callers_order(minilm_model_config, minilm_loaded, alone):
    # one request as issue 17's workload: 56 short texts and 8 long ones interleaved
    texts = [LONG if i % 8 == 3 else SINGLES[i % len(SINGLES)] for i in range(64)]
    service = _service(minilm_model_config, minilm_loaded, max_wait_ms=50)
    result = asyncio.run(service.embed(texts))
    lengths = [len(ids) for ids in minilm_loaded.tokenizer.encode_texts(texts)]
    shapes = list(_batcher(service).batch_shapes)
    padded = sum(rows * length for rows, length in shapes)
    assert sum(rows for rows, _ in shapes) == 64
    assert padded <= 1.5 * sum(lengths), (shapes, sum(lengths))  # one padded batch: 64 x max(lengths)
    assert padded < 0.25 * len(texts) * max(lengths), shapes
    for text, vector in zip(texts, result.vectors, strict=True):
        torch.testing.assert_close(vector, alone[text], atol=1e-5, rtol=0)


def test_the_oldest_request_is_served_first_when_the_queue_holds_more_than_one_forward(
        minilm_model_config, minilm_loaded, alone):
    # budget 256 fits one LONG alone; the short texts queued later must not all go before it
    service = _service(minilm_model_config, minilm_loaded, max_wait_ms=200, max_batch_tokens=256)
    long_tokens = len(minilm_loaded.tokenizer.encode_texts([LONG])[0])

    async def long_then_shorts():  # tokenizing runs in threads: queue LONG before the shorts arrive
        first = asyncio.ensure_future(service.embed([LONG]))
        while not _batcher(service).num_waiting:
            await asyncio.sleep(0.001)
        shorts = asyncio.ensure_future(_concurrently(service, [[t] for t in SINGLES]))
        return [await first, *await shorts]

    results = asyncio.run(long_then_shorts())
    assert list(_batcher(service).batch_shapes)[0] == (1, long_tokens)
    torch.testing.assert_close(results[0].vectors[0], alone[LONG], atol=1e-5, rtol=0)
