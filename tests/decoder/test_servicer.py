"""The Decoder servicer over a real socket: streaming Generate, GetInfo, errors as statuses, cancel."""

import asyncio

import grpc
import pytest
from decoder_testing import with_decoder_server

from services.decoder.config import DecoderConfig
from tessera.v1 import decoder_pb2


async def _with_server(model_dir, body):
    return await with_decoder_server(DecoderConfig(model_dir=str(model_dir), num_blocks=32, max_model_len=256), body)


def test_generate_info_errors_and_cancel(tiny_llama):
    async def body(stub, servicer):
        request = decoder_pb2.GenerateRequest(
            request_id="r1", prompt=[decoder_pb2.ContentPart(text="Hello there")],
            sampling=decoder_pb2.SamplingParams(max_tokens=6))
        responses = [r async for r in stub.Generate(request)]
        assert all(r.request_id == "r1" for r in responses)
        assert sum(len(r.token_ids) for r in responses) == 6
        assert responses[-1].finish_reason == "length" and responses[-1].usage.completion_tokens == 6
        assert responses[-1].usage.total_tokens == responses[-1].usage.prompt_tokens + 6

        info = await stub.GetInfo(decoder_pb2.DecoderInfoRequest())
        assert (info.num_blocks, info.num_free_blocks, info.block_size, info.max_model_len) == (32, 32, 16, 256)
        assert info.hidden_size == 64 and list(info.mrope_section) == [] and info.architecture == "LlamaForCausalLM"

        # n choices with logprobs over the wire; the second choice reuses the first one's prompt blocks
        shared = decoder_pb2.GenerateRequest(prompt_token_ids=list(range(200, 240)), sampling=decoder_pb2.SamplingParams(
            max_tokens=3, n=2, temperature=1.0, seed=3, logprobs=True, top_logprobs=2))
        responses = [r async for r in stub.Generate(shared)]
        assert sorted(r.index for r in responses if r.finish_reason) == [0, 1]
        assert all(len(r.logprobs) == len(r.token_ids) and all(len(lp.top) == 2 for lp in r.logprobs)
                   for r in responses)
        assert sorted(r.usage.cached_prompt_tokens for r in responses if r.finish_reason) == [0, 32]
        info = await stub.GetInfo(decoder_pb2.DecoderInfoRequest())
        assert info.prefix_cache_hits == 1 and info.prefix_cache_hit_tokens == 32 and info.num_cached_blocks >= 2

        bad = decoder_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling=decoder_pb2.SamplingParams(max_tokens=-1))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in stub.Generate(bad)]
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in error.value.details()

        long = decoder_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=decoder_pb2.SamplingParams(max_tokens=250))
        call = stub.Generate(long)
        await call.read()
        call.cancel()
        for _ in range(200):
            stats = servicer.engine.stats()
            if stats.num_free_blocks == 32 and stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert servicer.engine.stats().num_free_blocks == 32

    asyncio.run(_with_server(tiny_llama, body))


def test_main_parses_flags(tiny_llama):
    from services.decoder.__main__ import parse_args
    config = parse_args(["--address", "127.0.0.1:6000", "--model-dir", str(tiny_llama), "--block-size", "8",
                         "--mrope-section", "2,3,3", "--image-token", "<repo_name>", "--max-model-len", "128"])
    assert config.address == "127.0.0.1:6000"
    assert (config.block_size, config.mrope_section, config.max_model_len) == (8, (2, 3, 3), 128)
    assert parse_args(["--model-dir", str(tiny_llama), "--mrope-section", ""]).mrope_section is None
    config = parse_args(["--model-dir", str(tiny_llama), "--attention-backend", "cpu", "--no-prefix-caching"])
    assert (config.attention_backend, config.enable_prefix_caching) == ("cpu", False)
    assert parse_args(["--model-dir", str(tiny_llama)]).enable_prefix_caching is True
    config = parse_args(["--model-dir", str(tiny_llama), "--served-model-name", "a", "b", "--generation-config", "vllm"])
    assert (config.served_model_names, config.generation_config) == (("a", "b"), "vllm")
    assert parse_args(["--model-dir", str(tiny_llama)]).served_model_names == (tiny_llama.name,)
