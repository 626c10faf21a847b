"""Bad requests raise the right domain error before anything is scheduled."""

import asyncio

import pytest
import torch

from services.common.errors import InvalidArgument, NotFound, ResourceExhausted
from services.decoder.block_manager import BlockManager
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.multimodal import PromptInputs
from services.decoder.request import Request
from services.decoder.scheduler import Scheduler
from services.decoder.types import ChatMessage, GenerateInput, ImagePart, RawImagePart, SamplingParams, TextPart


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=64))
    yield engine
    engine.shutdown()


def _submit(engine, request):
    async def main():
        async for _ in engine.generate(request):
            pass
    asyncio.run(main())


def test_empty_prompt(engine):
    with pytest.raises(InvalidArgument, match="empty"):
        _submit(engine, GenerateInput(SamplingParams(max_tokens=4)))
    with pytest.raises(InvalidArgument, match="empty"):
        _submit(engine, GenerateInput(SamplingParams(max_tokens=4), prompt=(TextPart(""),)))


def test_max_tokens_zero():
    with pytest.raises(InvalidArgument, match=r"max_tokens must be >= 1 \(or unset for the rest of the context\), got 0"):
        SamplingParams(max_tokens=0)


def test_past_the_context_quotes_both_numbers(engine):
    with pytest.raises(InvalidArgument, match="prompt has 10 tokens and max_tokens 60; the model's context is 64"):
        _submit(engine, GenerateInput(SamplingParams(max_tokens=60), prompt_token_ids=tuple(range(10, 20))))


def test_image_to_text_only_decoder(engine):
    image = ImagePart(torch.zeros(4, 64), (1, 2, 2), (2, 3, 3))
    with pytest.raises(InvalidArgument, match="text-only"):
        _submit(engine, GenerateInput(SamplingParams(max_tokens=4), prompt=(TextPart("hi"), image)))
    with pytest.raises(InvalidArgument, match="encode them"):
        _submit(engine, GenerateInput(SamplingParams(max_tokens=4), prompt=(RawImagePart(),)))


def test_unknown_role_and_token_ids(engine):
    bad = (ChatMessage("robot", (TextPart("hi"),)),)
    with pytest.raises(InvalidArgument, match="unknown chat role 'robot'"):
        _submit(engine, GenerateInput(SamplingParams(max_tokens=4), messages=bad))
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        _submit(engine, GenerateInput(SamplingParams(max_tokens=4), prompt_token_ids=(1, 10**6)))
    for stop in (10**9, -1):
        with pytest.raises(InvalidArgument, match=rf"sampling.stop_token_ids holds {stop}, outside the vocabulary"):
            _submit(engine, GenerateInput(SamplingParams(max_tokens=4, stop_token_ids=(5, stop)), prompt_token_ids=(1, 2)))
    assert engine.stats().num_free_blocks == 64


def test_lora_without_registry_is_not_found(engine):
    with pytest.raises(NotFound, match="unknown adapter 'x'"):
        _submit(engine, GenerateInput(SamplingParams(max_tokens=4), prompt_token_ids=(1, 2, 3), lora="x"))
    assert engine.stats().num_free_blocks == 64


def test_waiting_queue_is_bounded():
    scheduler = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=16, max_waiting=1)
    scheduler.add(Request("a", "a", PromptInputs([1, 2]), SamplingParams(max_tokens=1)))
    with pytest.raises(ResourceExhausted, match="the queue holds 1"):
        scheduler.add(Request("b", "b", PromptInputs([1, 2]), SamplingParams(max_tokens=1)))


def test_lora_name_is_checked_before_anything_else(engine):
    with pytest.raises(InvalidArgument, match="adapter name 'xxx.*is invalid") as refusal:
        _submit(engine, GenerateInput(SamplingParams(max_tokens=4), prompt_token_ids=(1, 2, 3), lora="x" * 20_000))
    assert len(str(refusal.value)) < 300


def test_a_cancelled_waiting_request_frees_its_queue_place_at_once(tiny_llama):
    """max_waiting counts live requests only: while a step is still computing, a waiting request
    whose caller went away leaves the queue, and a new request is admitted in its place."""
    import threading

    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), num_blocks=64, max_model_len=64, max_num_seqs=1,
                                        max_waiting=1))
    execute, in_step, resume = engine.parts.runner.execute, threading.Event(), threading.Event()

    def slow_execute(out):
        in_step.set()
        resume.wait(30)
        return execute(out)

    engine.parts.runner.execute = slow_execute

    def request():
        return GenerateInput(SamplingParams(max_tokens=2, ignore_eos=True), prompt_token_ids=(1, 2, 3))

    async def main():
        running = asyncio.ensure_future(_collect(engine, request()))
        await asyncio.to_thread(in_step.wait, 30)          # the engine is inside a step
        waiting = engine.generate(request())
        first = asyncio.ensure_future(waiting.__anext__())  # admitted: the queue's one place
        while not engine.stats().num_waiting:
            await asyncio.sleep(0.01)
        with pytest.raises(ResourceExhausted):
            await _collect(engine, request())
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await waiting.aclose()                              # its caller goes away
        assert engine.stats().num_waiting == 0              # before the step ends
        admitted = asyncio.ensure_future(_collect(engine, request()))
        while not engine.stats().num_waiting:
            await asyncio.sleep(0.01)
        resume.set()
        return await running, await admitted

    try:
        assert asyncio.run(main()) == (2, 2)
        assert engine.stats().num_free_blocks == 64
    finally:
        resume.set()
        engine.shutdown()


async def _collect(engine, request):
    return sum([len(out.token_ids) async for out in engine.generate(request)])
