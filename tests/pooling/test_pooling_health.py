"""The dynamic batcher under faults: a failing forward fails only its batch; a dead drain is
reported by health (NOT_SERVING) and fails requests at once with UNAVAILABLE.

The fault is injected by making the batcher's forward (its collaborator, the model runner's
forward) raise, on the running service's batcher.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from services.pooling.engine import PoolingEngine
from services.pooling.servicer import PoolingServicer
from tessera.v1 import pooling_pb2, pooling_pb2_grpc
from tests.common.serving import NOT_SERVING, SERVING, WatchedHealth, serving


class BatcherKilled(BaseException):
    """Not an Exception: the step guard does not catch it, so the drain task ends."""


def _batcher(service: PoolingEngine, name: str):
    return service.models[name].batcher


def test_a_failing_forward_fails_only_its_batch(minilm_config, minilm_loaded):
    service = PoolingEngine(minilm_config, models={minilm_loaded.name: minilm_loaded})
    batcher = _batcher(service, minilm_loaded.name)
    forward = batcher._forward

    def failing(sequences):
        batcher._forward = forward
        raise RuntimeError("injected forward fault")

    async def main():
        batcher._forward = failing
        with pytest.raises(RuntimeError, match="injected forward fault"):
            await asyncio.wait_for(service.embed(["first"]), 30)
        assert (await asyncio.wait_for(service.embed(["second", "third"]), 30)).vectors.shape == (2, 384)
        assert batcher.health() is None and batcher.num_waiting == 0

    asyncio.run(main())


def test_a_dead_batcher_says_not_serving_and_fails_requests_at_once(minilm_config, minilm_loaded):
    service = PoolingEngine(minilm_config, models={minilm_loaded.name: minilm_loaded})

    def register(server):
        pooling_pb2_grpc.add_PoolingServicer_to_server(PoolingServicer(service), server)
        return [pooling_pb2.DESCRIPTOR.services_by_name["Pooling"].full_name]

    def killed(sequences):
        raise BatcherKilled("injected: the forward took the drain down")

    async def main():
        async with serving("pooling", register, service.health) as channel:
            stub = pooling_pb2_grpc.PoolingStub(channel)
            watch = WatchedHealth(channel, "tessera.v1.Pooling")
            await watch.wait_for(SERVING, 5)
            assert list((await stub.Embed(pooling_pb2.EmbedRequest(inputs=["hello"]))).embeddings.shape) == [1, 384]

            _batcher(service, minilm_loaded.name)._forward = killed
            with pytest.raises(grpc.aio.AioRpcError) as pending:
                await stub.Embed(pooling_pb2.EmbedRequest(inputs=["a", "b"]), timeout=10)
            died = time.monotonic()
            assert pending.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "BatcherKilled" in pending.value.details() and "batcher stopped" in pending.value.details()
            assert await watch.wait_for(NOT_SERVING, 3) - died < 1.5

            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as later:
                await stub.Embed(pooling_pb2.EmbedRequest(inputs=["c"]), timeout=10)
            assert later.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 0.5
            watch.close()

    asyncio.run(main())


def test_a_wedged_batcher_turns_unhealthy_after_the_bound(minilm_loaded):
    from services.pooling.config import PoolingConfig

    config = PoolingConfig(models=[minilm_loaded.config], wedged_after_s=1.0)
    service = PoolingEngine(config, models={minilm_loaded.name: minilm_loaded})
    batcher = _batcher(service, minilm_loaded.name)
    release = threading.Event()
    forward = batcher._forward

    def blocked(sequences):  # holds the compute thread until released
        release.wait(10)
        return forward(sequences)

    async def main():
        batcher._forward = blocked
        task = asyncio.create_task(service.embed(["stuck"]))
        started, reasons = time.monotonic(), []
        while not reasons[-1:] or reasons[-1] is None:
            await asyncio.sleep(0.1)
            reasons.append(batcher.health())
            assert time.monotonic() - started < 5
        assert reasons[0] is None and 0.9 <= time.monotonic() - started < 2.0 and "wedged" in reasons[-1]
        batcher._forward = forward
        release.set()
        assert (await asyncio.wait_for(task, 30)).vectors.shape == (1, 384)
        assert batcher.health() is None

    asyncio.run(main())


def test_the_wedge_bound_is_a_flag(minilm_dir):
    from services.pooling.__main__ import parse_args

    assert parse_args(["--model-dir", str(minilm_dir), "--wedged-after-s", "5"]).wedged_after_s == 5.0
    assert parse_args(["--model-dir", str(minilm_dir)]).wedged_after_s == 60.0
