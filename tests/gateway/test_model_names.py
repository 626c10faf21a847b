"""The gateway's gRPC Tokenize and Detokenize resolve `model` by every served name: the decoder's
DecoderInfo.served_model_names (its `model` alone when the list is empty), a pooling model's
aliases (resolved by the pooler), a ready adapter's name; `model` "" is the decoder's tokenizer
(as vLLM's /tokenize), the default pooling model's only in a cluster without a decoder. In-process
fakes of the decoder, pooling and adapter services on loopback, behind the real GatewayCore and GatewayServicer."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.limits import PoolingLimits
from services.common.server import create_server
from services.gateway import pools
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.servicer import GatewayServicer
from tessera.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    decoder_pb2,
    decoder_pb2_grpc,
    gateway_pb2_grpc,
    pooling_pb2,
    pooling_pb2_grpc,
)

POOLING_NAMES = ("org/p", "p")  # --served-model-name org/p p


class FakeDecoder(decoder_pb2_grpc.DecoderServicer):
    def __init__(self, served_model_names: list[str]):
        self.served_model_names = served_model_names
        self.tokenized: list[decoder_pb2.DecoderTokenizeRequest] = []

    async def GetInfo(self, request, context):
        return decoder_pb2.DecoderInfo(model="org/m", served_model_names=self.served_model_names,
                                       max_model_len=2048, num_blocks=8, num_free_blocks=8)

    async def Tokenize(self, request, context):
        self.tokenized.append(request)
        return decoder_pb2.DecoderTokenizeResponse(model="org/m", token_ids=[5, 6], count=2, max_model_len=2048,
                                                   tokens=["he", "llo"], special=[False, False])

    async def Detokenize(self, request, context):
        return decoder_pb2.DetokenizeResponse(model="org/m", text="hello")


class FakePooling(pooling_pb2_grpc.PoolingServicer):
    def __init__(self):
        self.tokenized: list[pooling_pb2.TokenizeRequest] = []
        self.pooled: list = []  # every Embed and Rerank that reached it

    async def Embed(self, request, context):
        self.pooled.append(request)
        return pooling_pb2.EmbedResponse(model="org/p")

    async def Rerank(self, request, context):
        self.pooled.append(request)
        return pooling_pb2.RerankResponse(model="org/p")

    async def GetInfo(self, request, context):
        return pooling_pb2.PoolingInfo(model="org/p", models=[
            pooling_pb2.PoolingModelInfo(model="org/p", kind="embedding", aliases=["p"])])

    async def Tokenize(self, request, context):
        if request.model not in ("", *POOLING_NAMES):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here")
        self.tokenized.append(request)
        return pooling_pb2.TokenizeResponse(model="org/p", results=[pooling_pb2.TokenizedInput(
            tokens=[pooling_pb2.Token(id=101, text="[CLS]", special=True)])])


class FakeAdapters(adapters_pb2_grpc.AdaptersServicer):
    async def ListAdapters(self, request, context):
        return adapters_pb2.ListAdaptersResponse(adapters=[adapters_pb2.AdapterInfo(name="ad", state="ready"),
                                                  adapters_pb2.AdapterInfo(name="gone", state="draining")])


async def _serve(add, servicer) -> tuple[grpc.aio.Server, str]:
    server = create_server()
    add(servicer, server)
    status = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    await status.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _run(scenario, served_model_names: list[str], with_decoder: bool = True):
    """`scenario(stub, decoder, pooling)` against a gateway over the fakes; the decoder's address
    holds nothing when not `with_decoder`."""
    async def main():
        decoder, pooling = FakeDecoder(served_model_names), FakePooling()
        servers = []
        for add, servicer in [(decoder_pb2_grpc.add_DecoderServicer_to_server, decoder),
                              (pooling_pb2_grpc.add_PoolingServicer_to_server, pooling),
                              (adapters_pb2_grpc.add_AdaptersServicer_to_server, FakeAdapters())]:
            servers.append(await _serve(add, servicer))
        (decoder_server, decoder_address), (_, pooling_address), (_, adapters_address) = servers
        if not with_decoder:
            await decoder_server.stop(None)
        gateway = GatewayCore(GatewayConfig(address="127.0.0.1:1", decoder=decoder_address,
                                                pooling=pooling_address, adapters=adapters_address, vision=""))
        await gateway.start()
        server = create_server(public=True)
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(gateway), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await scenario(gateway_pb2_grpc.GatewayStub(channel), decoder, pooling)
        finally:
            await gateway.close()
            for s in [server, *(s for s, _ in servers)]:
                await s.stop(None)

    asyncio.run(main())


async def _refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    assert error.value.code() == code, error.value.details()
    return error.value.details()


def test_every_served_name_reaches_the_decoder_and_answers_carry_the_first():
    async def scenario(stub, decoder, pooling):
        for name in ("", "org/m", "m", "mm"):
            reply = await stub.Tokenize(pooling_pb2.TokenizeRequest(model=name, inputs=["hello"]), timeout=10)
            assert reply.model == "org/m" and [t.id for t in reply.results[0].tokens] == [5, 6], name
            assert reply.max_model_len == 2048
        assert [r.text for r in decoder.tokenized] == ["hello"] * 4 and pooling.tokenized == []
        adapter = await stub.Tokenize(pooling_pb2.TokenizeRequest(model="ad", inputs=["hello"]), timeout=10)
        assert adapter.model == "ad"
        for name in ("", "org/m", "m"):  # "": the decoder's model, as vLLM's /detokenize (and /tokenize)
            back = await stub.Detokenize(decoder_pb2.DetokenizeRequest(model=name, token_ids=[5, 6]), timeout=10)
            assert (back.model, back.text) == ("org/m", "hello"), name

        # the chat fields travel to the decoder
        chat = pooling_pb2.TokenizeRequest(
            model="m", messages=[decoder_pb2.ChatMessage(role="user", content=[decoder_pb2.ContentPart(text="hi")])],
            add_generation_prompt=False, continue_final_message=True, chat_template_kwargs='{"enable_thinking": false}')
        await stub.Tokenize(chat, timeout=10)
        sent = decoder.tokenized[-1]
        assert sent.messages[0].content[0].text == "hi" and sent.HasField("add_generation_prompt")
        assert (sent.add_generation_prompt, sent.continue_final_message, sent.chat_template_kwargs) == \
            (False, True, '{"enable_thinking": false}')

        details = await _refused(stub.Tokenize(pooling_pb2.TokenizeRequest(inputs=["a", "b"]), timeout=10),
                                 grpc.StatusCode.INVALID_ARGUMENT)
        assert "inputs has 2 texts; the decoder's model 'org/m'" in details

    _run(scenario, ["org/m", "m", "mm"])


def test_pooling_aliases_go_to_the_pooler_and_unknown_names_are_not_found():
    async def scenario(stub, decoder, pooling):
        for name in POOLING_NAMES:
            reply = await stub.Tokenize(pooling_pb2.TokenizeRequest(model=name, inputs=["hello"]), timeout=10)
            assert reply.model == "org/p"
        assert [r.model for r in pooling.tokenized] == list(POOLING_NAMES) and decoder.tokenized == []
        for name in POOLING_NAMES:  # a pooling model's alias is a pooling model: refused as one, not unknown
            details = await _refused(stub.Detokenize(decoder_pb2.DetokenizeRequest(model=name, token_ids=[5]),
                                                     timeout=10), grpc.StatusCode.INVALID_ARGUMENT)
            assert f"{name!r} is a pooling model" in details
        for name in ("zzz", "gone"):  # "gone": an adapter that is not ready
            details = await _refused(stub.Tokenize(pooling_pb2.TokenizeRequest(model=name, inputs=["a"]), timeout=10),
                                     grpc.StatusCode.NOT_FOUND)
            assert details.endswith("the decoder's model 'org/m' or 'm' or a loaded adapter's name"), details
            await _refused(stub.Detokenize(decoder_pb2.DetokenizeRequest(model=name, token_ids=[5]), timeout=10),
                           grpc.StatusCode.NOT_FOUND)

    _run(scenario, ["org/m", "m"])


def test_a_decoder_without_served_names_answers_to_its_model():
    async def scenario(stub, decoder, pooling):
        reply = await stub.Tokenize(pooling_pb2.TokenizeRequest(model="org/m", inputs=["hello"]), timeout=10)
        assert reply.model == "org/m" and len(decoder.tokenized) == 1
        await _refused(stub.Tokenize(pooling_pb2.TokenizeRequest(model="m", inputs=["a"]), timeout=10),
                       grpc.StatusCode.NOT_FOUND)

    _run(scenario, [])


def test_no_model_is_the_default_pooling_model_in_a_cluster_without_a_decoder(monkeypatch):
    monkeypatch.setattr(pools, "READY_WAIT_S", 0.3)  # how long "" waits for a decoder to be ready

    async def scenario(stub, decoder, pooling):
        reply = await stub.Tokenize(pooling_pb2.TokenizeRequest(inputs=["hello"]), timeout=10)
        assert reply.model == "org/p" and [r.model for r in pooling.tokenized] == [""]

    _run(scenario, ["org/m"], with_decoder=False)


def test_embed_and_rerank_past_the_gateways_caps_are_refused_before_any_pooler_call():
    """The gateway checks every public RPC against its own caps (--max-batch-size, ...), as the
    pooling service would, so a request over them costs no downstream call."""
    cap = PoolingLimits().max_batch_size

    async def scenario(stub, decoder, pooling):
        refusals = [
            await _refused(stub.Embed(pooling_pb2.EmbedRequest(inputs=["a"] * (cap + 1)), timeout=10),
                           grpc.StatusCode.INVALID_ARGUMENT),
            await _refused(stub.Rerank(pooling_pb2.RerankRequest(query="q", documents=["d"] * (cap + 1)), timeout=10),
                           grpc.StatusCode.INVALID_ARGUMENT)]
        assert pooling.pooled == []
        assert all(f"{cap + 1}" in r and f"{cap}" in r and "--max-batch-size" in r for r in refusals), refusals
        assert refusals[0].startswith("inputs") and refusals[1].startswith("documents"), refusals
        await stub.Embed(pooling_pb2.EmbedRequest(inputs=["a"] * cap), timeout=10)
        await stub.Rerank(pooling_pb2.RerankRequest(query="q", documents=["d"] * cap), timeout=10)
        assert len(pooling.pooled) == 2

    _run(scenario, [])
