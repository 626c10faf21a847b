"""The token controls through both doors of a real gateway: its gRPC port and its HTTP API with the
official `openai` SDK (logit_bias as the SDK's own parameter, vLLM's allowed_token_ids and
bad_words in `extra_body`), over a decoder serving the tiny Llama on loopback, answers checked
against transformers' logits processors; refusals as INVALID_ARGUMENT / 400 naming the field.

Every server runs on one event loop in a background thread (the decoder's engine on its own
thread); the test talks to them over real sockets, as a client does."""

from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import openai
import pytest
import torch
from decoder_testing import hf_reference
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from transformers.generation import (
    LogitsProcessorList,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from services.common.server import create_server
from services.decoder.config import DecoderConfig
from services.decoder.engine import LLMEngine
from services.decoder.servicer import DecoderServicer
from services.decoder.tokens import bad_words_token_ids
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.http import http_server
from services.gateway.servicer import GatewayServicer
from tessera.client.errors import from_rpc_error
from tessera.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    decoder_pb2,
    decoder_pb2_grpc,
    gateway_pb2_grpc,
    pooling_pb2,
    pooling_pb2_grpc,
)

PROMPT = list(range(300, 340))
NUM_NEW = 8
EOS = 2


class _NoAdapters(adapters_pb2_grpc.AdaptersServicer):
    async def ListAdapters(self, request, context):
        return adapters_pb2.ListAdaptersResponse()


class _NoPoolingModel(pooling_pb2_grpc.PoolingServicer):
    async def GetInfo(self, request, context):
        return pooling_pb2.PoolingInfo()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """A decoder (tiny Llama), an empty adapter registry and pooler, the gateway's core behind its
    gRPC servicer and its HTTP server: all on one loop in a thread."""

    def __init__(self, model_dir) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[grpc.aio.Server] = []
        self.run(self._start(model_dir))

    def run(self, coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _serve(self, add, servicer) -> str:
        server = create_server()
        add(servicer, server)
        status = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(status, server)
        await status.set("", health_pb2.HealthCheckResponse.SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.servers.append(server)
        return f"127.0.0.1:{port}"

    async def _start(self, model_dir) -> None:
        self.decoder = DecoderServicer(LLMEngine(DecoderConfig(model_dir=str(model_dir), num_blocks=64,
                                                               max_model_len=512)))
        await self.decoder.engine.start()
        decoder = await self._serve(decoder_pb2_grpc.add_DecoderServicer_to_server, self.decoder)
        adapters = await self._serve(adapters_pb2_grpc.add_AdaptersServicer_to_server, _NoAdapters())
        pooling = await self._serve(pooling_pb2_grpc.add_PoolingServicer_to_server, _NoPoolingModel())
        config = GatewayConfig(address="127.0.0.1:1", decoder=decoder, pooling=pooling, adapters=adapters, vision="",
                               http_port=_free_port())
        self.core = GatewayCore(config)
        await self.core.start()
        gateway = create_server(public=True)
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(self.core), gateway)
        self.gateway_address = f"127.0.0.1:{gateway.add_insecure_port('127.0.0.1:0')}"
        await gateway.start()
        self.servers.append(gateway)
        self.http = http_server(config, self.core, 64 << 20)
        await self.http.start()
        self.http_url = f"http://127.0.0.1:{config.http_port}"
        self.model = self.decoder.engine.config.served_model_names[0]

    async def _stop(self) -> None:
        await self.http.stop()
        await self.core.close()
        for server in self.servers:
            await server.stop(None)
        await self.decoder.engine.stop()

    def close(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def stack(tiny_llama):
    running = Stack(tiny_llama)
    yield running
    running.close()


@pytest.fixture(scope="module")
def gateway(stack):
    with grpc.insecure_channel(stack.gateway_address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


@pytest.fixture(scope="module")
def sdk(stack):
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(hf_model):
    return hf_reference(hf_model, PROMPT, NUM_NEW)


def _hf_greedy(model, *processors) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=NUM_NEW, do_sample=False, logits_processor=LogitsProcessorList(processors))
    return out[0, len(PROMPT):].tolist()


def _grpc_ids(gateway, **sampling) -> list[int]:
    request = decoder_pb2.GenerateRequest(prompt_token_ids=PROMPT, sampling=decoder_pb2.SamplingParams(
        max_tokens=NUM_NEW, **sampling))
    return [t for response in gateway.Generate(request, timeout=60) for t in response.token_ids]


def _http_ids(sdk, model, **fields) -> list[int]:
    """A greedy completion of the token prompt, its ids read back from the logprobs' token_id:<id>."""
    reply = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=NUM_NEW, temperature=0, logprobs=0,
                                   extra_body={"return_tokens_as_token_ids": True, **fields.pop("extra_body", {})},
                                   **fields)
    return [int(token.removeprefix("token_id:")) for token in reply.choices[0].logprobs.tokens]


def _bad_word(tokenizer, greedy: list[int]) -> tuple[str, int]:
    """A word whose token sequences include greedy[k] alone, and k (from 2: the paths agree before)."""
    for k in range(2, len(greedy)):
        word = tokenizer.decode([greedy[k]]).strip()
        if word and word.isascii() and (greedy[k],) in bad_words_token_ids(tokenizer, [word]):
            return word, k
    raise AssertionError("no greedy token is a word of its own")


def test_logit_bias_through_grpc_and_the_sdk_equals_transformers(stack, gateway, sdk, hf_model, reference):
    greedy, logits = reference
    expected = _hf_greedy(hf_model, SequenceBiasLogitsProcessor([[[greedy[0]], -100.0]]))
    assert expected[0] == int(logits[0].topk(2).indices[1]) and expected != greedy  # the next-best token first
    assert _grpc_ids(gateway, logit_bias={greedy[0]: -100.0}) == expected
    assert _http_ids(sdk, stack.model, logit_bias={str(greedy[0]): -100}) == expected
    assert _http_ids(sdk, stack.model) == _grpc_ids(gateway) == greedy
    token = int(logits[0].argsort()[1000])
    assert _http_ids(sdk, stack.model, logit_bias={str(token): 100}) == [token] * NUM_NEW
    chat = sdk.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logit_bias={str(token): 100}, logprobs=True,
                                       extra_body={"return_tokens_as_token_ids": True})
    assert [entry.token for entry in chat.choices[0].logprobs.content] == [f"token_id:{token}"] * 3


def test_allowed_token_ids_and_bad_words_through_grpc_and_the_sdk(stack, gateway, sdk, tokenizer, hf_model,
                                                                   reference):
    greedy, logits = reference
    allowed = [int(t) for t in logits[0].argsort()[300:306]]
    expected = _hf_greedy(hf_model, PrefixConstrainedLogitsProcessor(lambda batch, ids: allowed, 1))
    assert _grpc_ids(gateway, allowed_token_ids=allowed) == expected
    assert _http_ids(sdk, stack.model, extra_body={"allowed_token_ids": allowed}) == expected
    hot = sdk.completions.create(model=stack.model, prompt=PROMPT, max_tokens=NUM_NEW, temperature=1.0, seed=3, n=3, logprobs=0,
                                 extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True})
    drawn = {int(t.removeprefix("token_id:")) for choice in hot.choices for t in choice.logprobs.tokens}
    assert drawn <= set(allowed) and len(drawn) > 1

    word, k = _bad_word(tokenizer, greedy)
    banned = [list(s) for s in bad_words_token_ids(tokenizer, [word])]
    expected = _hf_greedy(hf_model, NoBadWordsLogitsProcessor(banned, eos_token_id=EOS))
    assert expected[:k] == greedy[:k] and greedy[k] not in expected
    assert _grpc_ids(gateway, bad_words=[word]) == expected
    assert _http_ids(sdk, stack.model, extra_body={"bad_words": [word]}) == expected


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"7": 101}}, "logit_bias"), ({"logit_bias": {"seven": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"), ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ({"extra_body": {"allowed_token_ids": [3, 49152]}}, "allowed_token_ids"),
    ({"extra_body": {"bad_words": ["ok", "  "]}}, "bad_words"),
    ({"extra_body": {"bad_words": ["w"] * 129}}, "bad_words"),
])
def test_bad_controls_are_400_through_the_sdk_naming_the_field(stack, sdk, fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        sdk.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **fields)
    assert error.value.status_code == 400 and error.value.body["param"] == param, error.value.body


@pytest.mark.parametrize("sampling, field", [
    ({"logit_bias": {7: -100.5}}, "sampling.logit_bias"), ({"logit_bias": {49152: 1.0}}, "sampling.logit_bias"),
    ({"allowed_token_ids": [-1]}, "sampling.allowed_token_ids"), ({"bad_words": [""]}, "sampling.bad_words"),
    ({"bad_words": ["x" * 257]}, "sampling.bad_words[0]"),
])
def test_bad_controls_are_invalid_argument_through_grpc_naming_the_field(gateway, sampling, field):
    with pytest.raises(grpc.RpcError) as error:
        _grpc_ids(gateway, **sampling)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(error.value).field == field, error.value.details()
