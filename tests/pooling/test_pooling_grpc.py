"""End to end over a real socket: `python -m services.pooling` in a subprocess, called with the stubs."""

from __future__ import annotations

import base64
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.launch import ServiceProcess
from services.common.tensor import from_pb
from tessera.rich_status import error_info_of
from tessera.v1 import pooling_pb2, pooling_pb2_grpc


@pytest.fixture(scope="module")
def server():
    with ServiceProcess("services.pooling", ["--max-batch-size", "4"]) as service:
        channel = grpc.insecure_channel(service.address)
        yield channel, service.process
        channel.close()


def test_embed_rerank_info_health_and_errors(server):
    channel, process = server
    stub = pooling_pb2_grpc.PoolingStub(channel)
    texts = ["A cat sat on the mat.", "Paris is the capital of France."]

    info = stub.GetInfo(pooling_pb2.PoolingInfoRequest(), timeout=10)
    assert (info.model, info.pooling_mode, info.normalize, info.dimension, info.max_input_length,
            info.max_batch_size, info.rerank_method) == ("all-minilm-l6-v2", "mean", True, 384, 256, 4, "bi-encoder")

    floats = stub.Embed(pooling_pb2.EmbedRequest(inputs=texts), timeout=30)
    vectors = from_pb(floats.embeddings).numpy()
    assert vectors.shape == (2, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert floats.model == "all-minilm-l6-v2" and floats.usage.prompt_tokens > 2 * 2

    b64 = stub.Embed(pooling_pb2.EmbedRequest(model="all-minilm-l6-v2", inputs=texts,
                                              encoding_format=pooling_pb2.ENCODING_FORMAT_BASE64), timeout=30)
    decoded = np.stack([np.frombuffer(base64.b64decode(s), dtype="<f4") for s in b64.embeddings_base64])
    assert decoded.shape == (2, 384)
    assert np.allclose(decoded, vectors, atol=1e-6)

    raw = stub.Embed(pooling_pb2.EmbedRequest(inputs=texts, normalize=False), timeout=30)
    assert not np.allclose(np.linalg.norm(from_pb(raw.embeddings).numpy(), axis=1), 1.0, atol=1e-2)

    documents = ["Bananas are yellow.", "The capital of France is Paris.", "Rust is a programming language."]
    ranked = stub.Rerank(pooling_pb2.RerankRequest(query="What is the capital of France?", documents=documents,
                                                   top_n=2, return_documents=True), timeout=30)
    assert ranked.method == "bi-encoder" and len(ranked.results) == 2
    assert (ranked.results[0].index, ranked.results[0].document) == (1, documents[1])
    assert ranked.results[0].score >= ranked.results[1].score

    with pytest.raises(grpc.RpcError) as bad:
        stub.Embed(pooling_pb2.EmbedRequest(inputs=["fine", ""]), timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty string" in bad.value.details()
    assert error_info_of(bad.value).metadata == {"field": "inputs[1]"}  # the field to blame, as data (ErrorInfo)
    with pytest.raises(grpc.RpcError) as bad:
        stub.Rerank(pooling_pb2.RerankRequest(query="q", documents=["a"], top_n=0), timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_n" in bad.value.details()
    with pytest.raises(grpc.RpcError) as missing:
        stub.Embed(pooling_pb2.EmbedRequest(model="gpt-9", inputs=texts), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    # still answering after the refusals
    again = stub.Embed(pooling_pb2.EmbedRequest(inputs=texts[:1]), timeout=30)
    assert np.allclose(from_pb(again.embeddings).numpy()[0], vectors[0], atol=1e-5)
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="tessera.v1.Pooling"), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_tokenize_stream_info_and_concurrent_clients(server):
    channel, _ = server
    stub = pooling_pb2_grpc.PoolingStub(channel)
    info = stub.GetInfo(pooling_pb2.PoolingInfoRequest(), timeout=10)
    assert (info.dynamic_batching, info.max_batch_tokens, info.max_queue_size) == (True, 16384, 4096)
    assert [(m.model, m.kind, m.dimension, m.matryoshka) for m in info.models] == [
        ("all-minilm-l6-v2", "embedding", 384, False)]

    tokens = stub.Tokenize(pooling_pb2.TokenizeRequest(inputs=["A cat"]), timeout=10).results[0].tokens
    assert [(t.id, t.text, t.special, t.start, t.stop) for t in tokens] == [
        (101, "[CLS]", True, 0, 0), (1037, "a", False, 0, 1), (4937, "cat", False, 2, 5), (102, "[SEP]", True, 0, 0)]

    texts = [f"Sentence {i} about topic {i % 3}." for i in range(12)]
    alone = [from_pb(stub.Embed(pooling_pb2.EmbedRequest(inputs=[t]), timeout=30).embeddings).numpy()[0] for t in texts[:3]]
    requests = [pooling_pb2.EmbedRequest(inputs=[t], encoding_format=i % 2) for i, t in enumerate(texts)]
    streamed = list(stub.EmbedStream(iter(requests), timeout=60))
    assert len(streamed) == len(texts)
    for i, response in enumerate(streamed[:3]):
        vector = (from_pb(response.embeddings).numpy()[0] if i % 2 == 0
                  else np.frombuffer(base64.b64decode(response.embeddings_base64[0]), dtype="<f4"))
        assert np.allclose(vector, alone[i], atol=1e-5)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stub.Embed, pooling_pb2.EmbedRequest(inputs=[texts[i % 3]]), timeout=60) for i in range(16)]
        for i, future in enumerate(futures):
            assert np.allclose(from_pb(future.result().embeddings).numpy()[0], alone[i % 3], atol=1e-5)

    long_text = "word " * 300
    cut = stub.Embed(pooling_pb2.EmbedRequest(inputs=[long_text], truncate=True,
                                              truncation_direction=pooling_pb2.TRUNCATION_DIRECTION_LEFT), timeout=30)
    assert cut.usage.prompt_tokens == 256
    for bad, needle in [(pooling_pb2.EmbedRequest(inputs=["x"], dimensions=64), "Matryoshka"),
                        (pooling_pb2.EmbedRequest(inputs=[long_text]), "302 tokens")]:
        with pytest.raises(grpc.RpcError) as error:
            stub.Embed(bad, timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in error.value.details()
    with pytest.raises(grpc.RpcError) as error:  # a bad request inside a stream ends it with its status
        list(stub.EmbedStream(iter([requests[0], pooling_pb2.EmbedRequest(inputs=[""])]), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty string" in error.value.details()


def test_reflection_lists_the_pooling_service(server):
    channel, _ = server
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"tessera.v1.Pooling", "grpc.health.v1.Health"} <= names


def test_sigterm_drains_and_exits_cleanly(server):
    channel, process = server
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
