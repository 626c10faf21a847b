"""Fail fast, never lie: the decoder turns SERVING only after one real warm-up step through its
backends; the step gives back every block and its adapter slot; a backend that cannot run here
fails the start (health never SERVING) with one line naming the flags."""

from __future__ import annotations

import asyncio
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.launch import free_port
from services.common.server import insecure_channel, serve
from services.decoder import engine_parts
from services.decoder.config import DecoderConfig
from services.decoder.engine import LLMEngine, start_engine
from services.decoder.servicer import DecoderServicer
from services.decoder.warmup import warm_up
from tessera.v1 import decoder_pb2, decoder_pb2_grpc
from tests.common.serving import NOT_SERVING, SERVING, serving

TRITON_KERNEL = "services.decoder.attention.triton_kernel"


def _register(engine: LLMEngine):
    def register(server):
        decoder_pb2_grpc.add_DecoderServicer_to_server(DecoderServicer(engine), server)
        return [decoder_pb2.DESCRIPTOR.services_by_name["Decoder"].full_name]

    return register


def _check(address: str) -> int:
    """Health of `address` now, asked from this thread over a channel of its own."""
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_serving_only_after_the_warm_up_which_frees_its_blocks_and_slot(tiny_llama, monkeypatch):
    config = DecoderConfig(model_dir=str(tiny_llama), device="cpu", num_blocks=16, max_model_len=128)
    engine = LLMEngine(config)
    address = f"127.0.0.1:{free_port()}"
    seen = []
    original = engine_parts.warm_up_parts

    def observed_warm_up(config, parts):  # on the engine thread, while `start` is awaited
        seen.append(("before", _check(address)))
        original(config, parts)
        seen.append(("after", _check(address), parts.block_manager.num_free_blocks, parts.bank.residency()))

    monkeypatch.setattr(engine_parts, "warm_up_parts", observed_warm_up)

    async def main():
        async with serving("decoder", _register(engine), engine.health, engine.start, engine.stop, address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == SERVING
            stats = engine.stats()
            assert (stats.num_free_blocks, stats.num_running, stats.num_waiting) == (16, 0, 0)
            assert (stats.num_cached_blocks, stats.prefix_cache_queries) == (0, 0)  # no trace in the prefix cache
            assert engine.parts.bank.residency() == {} and engine.parts.bank.num_swaps == 0
            assert engine.parts.bank.factors(next(iter(engine.parts.bank.module_shapes))) is not None  # the LoRA path ran

    asyncio.run(main())
    assert seen == [("before", NOT_SERVING), ("after", NOT_SERVING, 16, {})]


def test_warm_up_samples_through_the_engine_parts_and_gives_everything_back(tiny_llama):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), device="cpu", num_blocks=4, block_size=1,
                                        max_model_len=128))
    try:
        for max_tokens, num_sampled in ((64, 2), (1, 1)):
            free = engine.parts.block_manager.free_block_ids()
            ids = warm_up(engine.parts.scheduler, engine.parts.runner, engine.parts.bank, max_tokens, engine.device)
            assert len(ids) == num_sampled and all(0 <= i < engine.parts.model.spec.vocab_size for i in ids)
            assert sorted(engine.parts.block_manager.free_block_ids()) == sorted(free) == [0, 1, 2, 3]
            assert not engine.parts.scheduler.has_work() and engine.parts.bank.residency() == {}
        first = warm_up(engine.parts.scheduler, engine.parts.runner, engine.parts.bank, 64, engine.device)
        assert warm_up(engine.parts.scheduler, engine.parts.runner, engine.parts.bank, 64, engine.device) == first  # seeded
    finally:
        engine.shutdown()


def test_a_backend_that_fails_its_warm_up_is_refused_and_never_serving(tiny_llama, monkeypatch):
    """The Triton kernel defined without the interpreter on a machine without a GPU (what a user gets
    with --attention-backend triton there, had the config check not refused it first)."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU the Triton kernel runs: there is no failing backend to start")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = DecoderConfig(model_dir=str(tiny_llama), device="cpu", attention_backend="triton", num_blocks=16,
                           max_model_len=128)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delitem(sys.modules, TRITON_KERNEL, raising=False)  # defined afresh, without the interpreter
    engine = LLMEngine(config)
    address = f"127.0.0.1:{free_port()}"

    async def main():
        task = asyncio.create_task(serve("decoder", address, _register(engine), engine))
        statuses = set()
        async with insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not task.done():
                try:
                    statuses.add((await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)).status)
                except grpc.aio.AioRpcError:
                    pass  # not listening yet, or closed again
                await asyncio.sleep(0.02)
        with pytest.raises(ValueError) as refused:
            await task
        return statuses, str(refused.value)

    try:
        statuses, message = asyncio.run(main())
    finally:
        sys.modules.pop(TRITON_KERNEL, None)
    assert SERVING not in statuses and NOT_SERVING in statuses
    assert message.startswith("the warm-up step failed on --device cpu (cpu) with --attention-backend triton")
    assert "\n" not in message and "RuntimeError" in message
    with pytest.raises(OSError):  # the port was closed again
        _check_closed(address)
    engine.shutdown()


def _check_closed(address: str) -> None:
    try:
        _check(address)
    except grpc.RpcError as error:
        raise OSError(f"{address} does not answer: {error.code()}") from error
