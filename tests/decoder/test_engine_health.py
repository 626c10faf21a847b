"""The engine loop under faults: a bad step fails only its requests; a dead or wedged engine is
reported by health (NOT_SERVING) and fails requests at once with UNAVAILABLE.

Faults are injected by making one of the engine's collaborators (scheduler, model runner) raise or
block, on the running engine instance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import grpc
import pytest
import torch

from services.common.errors import Unavailable
from services.decoder.adapter_source import InMemoryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine import LLMEngine, start_engine
from services.decoder.lora import LoRAWeights
from services.decoder.servicer import DecoderServicer
from services.decoder.types import GenerateInput, SamplingParams
from tessera.v1 import decoder_pb2, decoder_pb2_grpc
from tests.common.serving import NOT_SERVING, SERVING, WatchedHealth, serving


class EngineKilled(BaseException):
    """Not an Exception: nothing in the step guard catches it, so the engine thread ends."""


def _request(request_id: str, max_tokens: int = 4) -> GenerateInput:
    return GenerateInput(SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=request_id,
                         prompt_token_ids=tuple(range(100, 120)))


async def _tokens(engine: LLMEngine, request: GenerateInput, lora: str = "") -> list[int]:
    return [t async for out in engine.generate(dataclasses.replace(request, lora=lora)) for t in out.token_ids]


def _fail_once(owner, name: str):
    """Make `owner.name` raise RuntimeError on its next call, then behave again."""
    original = getattr(owner, name)

    def failing(*args, **kwargs):
        setattr(owner, name, original)
        raise RuntimeError(f"injected fault in {name}")

    setattr(owner, name, failing)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=32, max_model_len=256, max_num_seqs=1,
                                        wedged_after_s=1.0), InMemoryAdapterSource())
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("owner,name", [("scheduler", "schedule"), ("runner", "execute"), ("scheduler", "update")])
def test_a_bad_step_fails_only_its_requests(engine, owner, name):
    torch.manual_seed(0)  # a small adapter on q_proj: each request holds a lease on its slot
    weights = LoRAWeights("digest-x", {f"model.layers.{i}.self_attn.q_proj": (
        torch.randn(4, 64) * 0.1, torch.randn(64, 4) * 0.1) for i in range(2)})
    slot = engine.parts.bank.load(weights)
    engine.adapters.add("x", weights)

    async def main():
        _fail_once(getattr(engine.parts, owner), name)
        # max_num_seqs 1: the failing step holds one request; the other waits, then runs
        results = await asyncio.wait_for(asyncio.gather(*(
            _tokens(engine, _request(key), "x") for key in ("a", "b")),
            return_exceptions=True), 30)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 1 and isinstance(failed[0], RuntimeError)
        assert f"injected fault in {name}" in str(failed[0])
        assert [len(r) for r in results if not isinstance(r, BaseException)] == [4]
        assert len(await asyncio.wait_for(_tokens(engine, _request("c")), 30)) == 4  # the engine keeps serving

    asyncio.run(main())
    stats = engine.stats()
    assert (stats.num_free_blocks, stats.num_running, stats.num_waiting) == (32, 0, 0)
    assert engine.parts.bank.num_leases(slot) == 0
    assert engine.core.is_alive() and engine.health() is None


def test_a_wedged_engine_turns_unhealthy_after_the_bound(engine):
    release, entered = threading.Event(), threading.Event()
    execute = engine.parts.runner.execute

    def blocked(out):
        entered.set()
        release.wait(10)
        return execute(out)

    async def main():
        engine.parts.runner.execute = blocked
        task = asyncio.create_task(_tokens(engine, _request("w")))
        try:
            assert await asyncio.to_thread(entered.wait, 5)
            started, reasons = time.monotonic(), []
            while not reasons[-1:] or reasons[-1] is None:
                reasons.append(engine.health())
                assert time.monotonic() - started < 5
                await asyncio.sleep(0.1)
            waited = time.monotonic() - started
            # healthy while the step is shorter than the bound (1 s), unhealthy once it is not
            assert reasons[0] is None and 0.9 <= waited < 2.0
            assert "wedged" in reasons[-1] and "1 s" in reasons[-1]
        finally:
            engine.parts.runner.execute = execute
            release.set()
        assert len(await asyncio.wait_for(task, 30)) == 4
        assert engine.health() is None  # steps complete again

    asyncio.run(main())


def test_a_dead_engine_says_not_serving_and_fails_requests_at_once(tiny_llama):
    engine = LLMEngine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=32, max_model_len=256))
    servicer = DecoderServicer(engine)

    def register(server):
        decoder_pb2_grpc.add_DecoderServicer_to_server(servicer, server)
        return [decoder_pb2.DESCRIPTOR.services_by_name["Decoder"].full_name]

    def killed(out=None):
        raise EngineKilled("injected: the scheduler took the engine thread down")

    async def main():
        async with serving("decoder", register, engine.health, start=engine.start, stop=engine.stop) as channel:
            stub = decoder_pb2_grpc.DecoderStub(channel)
            watch = WatchedHealth(channel, "tessera.v1.Decoder")
            await watch.wait_for(SERVING, 5)
            request = decoder_pb2.GenerateRequest(prompt_token_ids=list(range(100, 120)),
                                                  sampling=decoder_pb2.SamplingParams(max_tokens=4))
            assert len([r async for r in stub.Generate(request)]) >= 1

            servicer.engine.parts.scheduler.schedule = killed
            with pytest.raises(grpc.aio.AioRpcError) as pending:
                [r async for r in stub.Generate(request, timeout=10)]
            died = time.monotonic()
            assert pending.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "EngineKilled" in pending.value.details() and "decoder engine stopped" in pending.value.details()
            assert await watch.wait_for(NOT_SERVING, 3) - died < 1.5

            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as later:
                [r async for r in stub.Generate(request, timeout=10)]
            assert later.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 0.5
            info = await stub.GetInfo(decoder_pb2.DecoderInfoRequest())
            assert (info.num_running, info.num_waiting) == (0, 0)
            watch.close()

    asyncio.run(main())


def test_the_wedge_bound_is_a_flag(tiny_llama):
    from services.decoder.__main__ import parse_args

    assert parse_args(["--model-dir", str(tiny_llama), "--wedged-after-s", "5"]).wedged_after_s == 5.0
    assert parse_args(["--model-dir", str(tiny_llama)]).wedged_after_s == 60.0
    with pytest.raises(ValueError, match="wedged_after_s must be > 0 seconds, got -1"):
        DecoderConfig(model_dir=str(tiny_llama), wedged_after_s=-1)


def test_an_engine_not_started_refuses_with_unavailable(tiny_llama):
    """Before `start` nothing is loaded: generate and info raise UNAVAILABLE, health has no verdict
    (the server says NOT_SERVING until start returns), and stop is safe."""
    engine = LLMEngine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=32, max_model_len=256))

    async def main():
        with pytest.raises(Unavailable, match="still loading its model"):
            await _tokens(engine, _request("early"))
        with pytest.raises(Unavailable, match="still loading its model"):
            engine.info()
        assert engine.health() is None and not engine.started
        await engine.stop()

    asyncio.run(main())
