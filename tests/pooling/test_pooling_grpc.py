"""End to end over a real socket: `python -m services.pooling` in a subprocess, called with the stubs."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.tensor import from_pb
from tessera.v1 import pooling_pb2, pooling_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(channel, process, log_path) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text()
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"pooling service not SERVING after {STARTUP_S} s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    address = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log_path = tmp_path_factory.mktemp("pooling") / "server.log"
    log = log_path.open("w")  # a file, not a pipe: a full pipe would stall the server
    process = subprocess.Popen([sys.executable, "-m", "services.pooling", "--address", address, "--max-batch-size", "4"],
                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(address)
    try:
        _wait_serving(channel, process, log_path)
        yield channel, process
    finally:
        channel.close()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


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
