"""tessera.client (Client and AsyncClient) against the running cluster: every method's answer
equals the gateway's own gRPC answer for the same request; errors arrive as the client's
exceptions; UNAVAILABLE is retried only before the first message."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from PIL import Image

import tessera.client as tc
from services.common.tensor import from_pb
from tessera.cli.demo import write_random_lora
from tessera.client import InvalidArgument
from tessera.paths import default_decoder_dir
from tessera.v1 import adapters_pb2, decoder_pb2, gateway_pb2, gateway_pb2_grpc, pooling_pb2, vision_pb2

from .conftest import run_cli
from .test_generate import chat_request, collect

PROMPT = "What is the capital of France?"
TEXTS = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stocks fell sharply today."]
DOCUMENTS = ["Bananas are yellow.", "Paris is the capital of France.", "The sea is deep."]
ADAPTER = "client-lora"


def png_bytes(color=(30, 120, 200)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def client(gateway_address):
    with tc.Client(gateway_address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def adapter(gateway, adapter_root):
    """A random PEFT LoRA under the adapter root (registered by the test that loads it)."""
    write_random_lora(adapter_root / ADAPTER, default_decoder_dir(), seed=3)
    yield ADAPTER
    try:
        gateway.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name=ADAPTER), timeout=30)
    except grpc.RpcError:
        pass


def test_chat_stream_equals_grpc_and_deltas_make_the_result(client, gateway):
    expected = collect(gateway, chat_request(PROMPT, 8))
    stream = client.chat_stream([tc.Message("user", PROMPT)], max_tokens=8)
    deltas = list(stream)
    result = stream.result
    assert result.token_ids == expected["ids"] and result.text == expected["text"] != ""
    assert "".join(d.text for d in deltas) == result.text
    assert [i for d in deltas for i in d.token_ids] == result.token_ids
    assert result.finish_reason == expected["finish"] == deltas[-1].finish_reason
    assert result.usage.completion_tokens == len(result.token_ids)
    assert result.usage.prompt_tokens == expected["usage"].prompt_tokens
    assert result.replica.count(":") == 1  # host:port of the decoder replica


def test_generate_raw_prompt_and_token_ids_equal_grpc(client, gateway):
    request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text="The capital of France is")],
                                          sampling=decoder_pb2.SamplingParams(max_tokens=4))
    expected = collect(gateway, request)
    by_text = client.generate("The capital of France is", max_tokens=4)
    assert by_text.token_ids == expected["ids"] and by_text.text == expected["text"]
    ids = [504, 3575, 282, 4649]  # any ids of the decoder's vocabulary
    request = decoder_pb2.GenerateRequest(prompt_token_ids=ids, sampling=decoder_pb2.SamplingParams(max_tokens=4))
    assert client.generate(ids, max_tokens=4).token_ids == collect(gateway, request)["ids"]


def test_sampling_n_logprobs_and_seed(client, gateway):
    request = chat_request(PROMPT, 4, n=2, temperature=1.0, seed=11)
    expected = {}
    for response in gateway.Generate(request, timeout=120):
        expected.setdefault(response.index, []).extend(response.token_ids)
    result = client.chat([{"role": "user", "content": PROMPT}], max_tokens=4, n=2, temperature=1.0, seed=11,
                         logprobs=True, top_logprobs=2)
    assert [c.index for c in result.choices] == [0, 1]
    for choice in result.choices:
        assert choice.token_ids == expected[choice.index] and choice.finish_reason == "length"
        assert [p.token_id for p in choice.logprobs] == choice.token_ids
        assert all(len(p.top) == 2 and p.logprob <= 0 for p in choice.logprobs)
    # the request's usage: both choices' tokens, the prompt once (as OpenAI's n)
    assert result.usage.completion_tokens == sum(len(c.token_ids) for c in result.choices) == 8
    assert result.usage.total_tokens == result.usage.prompt_tokens + 8


def test_chat_with_an_image_from_bytes_path_or_pil(client, gateway, tmp_path):
    data = png_bytes()
    request = chat_request("Describe the image.", 3)
    request.messages[0].content.insert(0, decoder_pb2.ContentPart(image=vision_pb2.ImageInput(data=data)))
    expected = collect(gateway, request)
    path = tmp_path / "image.png"
    path.write_bytes(data)
    for image in (data, path, Image.open(io.BytesIO(data))):
        result = client.chat([{"role": "user", "content": [image, "Describe the image."]}], max_tokens=3)
        assert result.token_ids == expected["ids"], type(image)
        assert result.usage.image_tokens == expected["usage"].image_tokens > 0
    # OpenAI's content parts: the same answer
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    openai = client.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                       {"type": "text", "text": "Describe the image."}]}],
                         max_tokens=3)
    assert openai.token_ids == expected["ids"] and openai.usage.image_tokens == expected["usage"].image_tokens


def test_embed_rerank_tokenize_equal_grpc(client, gateway):
    expected = from_pb(gateway.Embed(pooling_pb2.EmbedRequest(inputs=TEXTS), timeout=60).embeddings).numpy()
    result = client.embed(TEXTS)
    assert result.embeddings.dtype == np.float32 and result.embeddings.shape == expected.shape == (3, 384)
    np.testing.assert_array_equal(result.embeddings, expected)
    np.testing.assert_array_equal(client.embed(TEXTS, encoding_format="base64").embeddings, expected)
    assert result.prompt_tokens > len(TEXTS) and result.model

    grpc_rerank = gateway.Rerank(pooling_pb2.RerankRequest(query=PROMPT, documents=DOCUMENTS, return_documents=True),
                                 timeout=60)
    rerank = client.rerank(PROMPT, DOCUMENTS, return_documents=True)
    assert [(r.index, r.score, r.document) for r in rerank.results] == \
        [(r.index, r.score, r.document) for r in grpc_rerank.results]
    assert rerank.results[0].index == 1 and rerank.method == "bi-encoder"
    assert len(client.rerank(PROMPT, DOCUMENTS, top_n=1).results) == 1
    long_documents = [DOCUMENTS[0] * 200, DOCUMENTS[1]]
    with pytest.raises(InvalidArgument, match=r"document 0 has .*\(set truncate to cut it"):
        client.rerank(PROMPT, long_documents)
    grpc_cut = gateway.Rerank(pooling_pb2.RerankRequest(query=PROMPT, documents=long_documents, truncate=True), timeout=60)
    assert [(r.index, r.score) for r in client.rerank(PROMPT, long_documents, truncate=True).results] == \
        [(r.index, r.score) for r in grpc_cut.results]

    embedding_model = client.info().pooling.model  # named: "" is the decoder's tokenizer
    grpc_tokens = gateway.Tokenize(pooling_pb2.TokenizeRequest(model=embedding_model, inputs=["Hello tessera"]),
                                   timeout=60)
    tokens = client.tokenize("Hello tessera", model=embedding_model).tokens[0]
    assert tokens[1].stop > 0  # the pooling tokenizer's character offsets
    assert [(t.id, t.text, t.special, t.start, t.stop) for t in tokens] == \
        [(t.id, t.text, t.special, t.start, t.stop) for t in grpc_tokens.results[0].tokens]


def test_adapters_load_list_generate_unload(client, gateway, adapter):
    info = client.load_adapter(adapter, adapter, replace=True)
    assert info.name == adapter and info.rank == 8 and len(info.digest) == 64 and info.state == "ready"
    assert adapter in [a.name for a in client.list_adapters()]
    with pytest.raises(tc.AlreadyExists):
        client.load_adapter(adapter, adapter)
    request = chat_request(PROMPT, 6)
    request.lora = adapter
    assert client.chat([tc.Message("user", PROMPT)], max_tokens=6, lora=adapter).token_ids == \
        collect(gateway, request)["ids"]
    client.unload_adapter(adapter)
    assert adapter not in [a.name for a in client.list_adapters()]
    with pytest.raises(tc.NotFound):
        client.unload_adapter(adapter)


def test_info_equals_grpc(client, gateway):
    expected = gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30)
    info = client.info()
    assert info.decoder.max_model_len == expected.decoder.max_model_len == 2048
    assert info.decoder.model == expected.decoder.model and info.pooling.dimension == 384
    assert info.vision.encoder == expected.vision.encoder and info.vision.encoder_cache is not None
    assert [(r.service, r.address) for r in info.replicas] == [(r.service, r.address) for r in expected.replicas]


def test_errors_and_deadlines(client):
    with pytest.raises(tc.InvalidArgument) as error:
        client.generate("hi", max_tokens=-1)
    assert "max_tokens" in error.value.details and error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(tc.NotFound):
        client.generate("hi", max_tokens=4, lora="no-such-adapter")
    with pytest.raises(tc.DeadlineExceeded):
        client.generate("hi", max_tokens=1000, ignore_eos=True, timeout=0.2)
    stream = client.generate_stream("hi", max_tokens=4)
    with pytest.raises(RuntimeError):
        stream.result  # noqa: B018 - not read yet


def test_async_client_equals_sync(gateway_address, client, adapter):
    sync = {
        "chat": client.chat([tc.Message("user", PROMPT)], max_tokens=6),
        "generate": client.generate("The capital of France is", max_tokens=3),
        "embed": client.embed(TEXTS).embeddings,
        "rerank": client.rerank(PROMPT, DOCUMENTS).results,
        "tokenize": client.tokenize(TEXTS, model=client.info().pooling.model).tokens,
        "info": client.info().decoder.model,
    }
    embedding_model = client.info().pooling.model

    async def scenario():
        async with tc.AsyncClient(gateway_address, timeout=120) as aclient:
            stream = aclient.chat_stream([tc.Message("user", PROMPT)], max_tokens=6)
            deltas = [d async for d in stream]
            assert "".join(d.text for d in deltas) == stream.result.text
            loaded = await aclient.load_adapter(adapter, adapter, replace=True)
            names = [a.name for a in await aclient.list_adapters()]
            await aclient.unload_adapter(adapter)
            with pytest.raises(tc.InvalidArgument):
                await aclient.generate("hi", max_tokens=-1)
            return {
                "chat": stream.result,
                "generate": await aclient.generate("The capital of France is", max_tokens=3),
                "embed": (await aclient.embed(TEXTS)).embeddings,
                "rerank": (await aclient.rerank(PROMPT, DOCUMENTS)).results,
                "tokenize": (await aclient.tokenize(TEXTS, model=embedding_model)).tokens,
                "info": (await aclient.info()).decoder.model,
            }, loaded, names

    results, loaded, names = asyncio.run(scenario())
    assert results["chat"].token_ids == sync["chat"].token_ids and results["chat"].text == sync["chat"].text
    assert results["generate"].token_ids == sync["generate"].token_ids
    np.testing.assert_array_equal(results["embed"], sync["embed"])
    assert results["rerank"] == sync["rerank"] and results["tokenize"] == sync["tokenize"]
    assert results["info"] == sync["info"]
    assert loaded.name == adapter and adapter in names


class _FlakyGateway(gateway_pb2_grpc.GatewayServicer):
    """Forwards to the real gateway, after refusing the first `fail_first` calls with UNAVAILABLE;
    with `break_after_first`, a Generate ends UNAVAILABLE right after its first real message."""

    def __init__(self, gateway, fail_first: int, break_after_first: bool = False):
        self.gateway, self.fail_first, self.break_after_first = gateway, fail_first, break_after_first
        self.calls = 0
        self._lock = threading.Lock()

    def _refuse(self, context) -> None:
        with self._lock:
            self.calls += 1
            refuse = self.calls <= self.fail_first
        if refuse:
            context.abort(grpc.StatusCode.UNAVAILABLE, "decoder: replica down")

    def Generate(self, request, context):
        self._refuse(context)
        for response in self.gateway.Generate(request, timeout=60):
            yield response
            if self.break_after_first:
                context.abort(grpc.StatusCode.UNAVAILABLE, "decoder: connection lost mid-stream")

    def Embed(self, request, context):
        self._refuse(context)
        return self.gateway.Embed(request, timeout=60)


@pytest.fixture
def flaky(gateway):
    """Start a _FlakyGateway on a free port: yields (start(servicer) -> address)."""
    servers = []

    def start(servicer) -> str:
        server = grpc.server(ThreadPoolExecutor(4))
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def test_unavailable_is_retried_before_the_first_token(gateway, flaky):
    expected = collect(gateway, chat_request(PROMPT, 8))
    servicer = _FlakyGateway(gateway, fail_first=2)
    retry = tc.RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)
    with tc.Client(flaky(servicer), retry=retry, timeout=60) as c:
        assert c.chat([tc.Message("user", PROMPT)], max_tokens=8).token_ids == expected["ids"]
        assert servicer.calls == 3
        servicer.calls = 0
        np.testing.assert_array_equal(c.embed(TEXTS).embeddings, client_embed(gateway))
        assert servicer.calls == 3

    servicer = _FlakyGateway(gateway, fail_first=5)
    with tc.Client(flaky(servicer), retry=retry, timeout=60) as c, pytest.raises(tc.Unavailable) as error:
        c.chat([tc.Message("user", PROMPT)], max_tokens=8)
    assert servicer.calls == 3 and "replica down" in error.value.details
    with tc.Client(flaky(_FlakyGateway(gateway, 1)), retry=tc.NO_RETRY) as c, pytest.raises(tc.Unavailable):
        c.embed(TEXTS)


def test_unavailable_after_the_first_token_is_not_retried(gateway, flaky):
    servicer = _FlakyGateway(gateway, fail_first=0, break_after_first=True)
    with tc.Client(flaky(servicer), retry=tc.RetryPolicy(initial_backoff_s=0.01), timeout=60) as c:
        stream = c.chat_stream([tc.Message("user", PROMPT)], max_tokens=8)
        deltas = []
        with pytest.raises(tc.Unavailable) as error:
            for delta in stream:
                deltas.append(delta)
    assert len(deltas) == 1 and servicer.calls == 1 and "mid-stream" in error.value.details


def client_embed(gateway) -> np.ndarray:
    return from_pb(gateway.Embed(pooling_pb2.EmbedRequest(inputs=TEXTS), timeout=60).embeddings).numpy()


def test_cli_generate_n_json_usage_sums_every_choice(gateway_address, hf_decoder):
    _, tokenizer = hf_decoder
    prompt = "Once upon a time"
    result = run_cli(gateway_address, "generate", prompt, "--n", "3", "--temperature", "1.0", "--seed", "5",
                     "--max-tokens", "6", "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    lengths = [len(c["token_ids"]) for c in answer["choices"]]
    assert len(lengths) == 3 and all(lengths)
    usage = answer["usage"]
    assert usage["completion_tokens"] == sum(lengths)  # every choice's, not the last to finish
    assert usage["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])  # the prompt once
    assert usage["total_tokens"] == usage["prompt_tokens"] + sum(lengths)


def test_cli_tokenize_info_and_errors(gateway_address, gateway, hf_decoder):
    _, tokenizer = hf_decoder
    result = run_cli(gateway_address, "tokenize", "Hello tessera", "Naïve café", "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)  # no --model: the decoder's tokenizer, each text on its own
    assert answer["model"] == gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=60).decoder.model
    assert [[t["id"] for t in row] for row in answer["tokens"]] == \
        [tokenizer(text)["input_ids"] for text in ("Hello tessera", "Naïve café")]
    result = run_cli(gateway_address, "info", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["decoder"]["maxModelLen"] == 2048
    result = run_cli(gateway_address, "adapters", "unload", "no-such-adapter")
    assert result.returncode == 1 and result.stderr.startswith("error: NOT_FOUND: ")
