"""One real cluster for the end-to-end tests: five OS processes started by `tessera up`'s code.

The cluster uses the prepared default models (`make test` prepares them), free ports, and a
temporary adapter root and log directory. Tests talk to it over real sockets only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import INTERNAL_TOKEN_METADATA
from services.common.server import CHANNEL_OPTIONS
from tessera.cli.up.launch import Cluster
from tessera.cli.up.spec import SERVICES, ClusterSpec
from tessera.paths import default_decoder_dir, default_embedding_dir
from tessera.v1 import gateway_pb2_grpc, pooling_pb2

# Small enough that "image over the byte cap" needs no huge upload.
VISION_MAX_BYTES = 200_000
DECODER_MAX_MODEL_LEN = 2048


def _free_base_port() -> int:
    for _ in range(200):
        base = 20000 + (os.getpid() * 7919 + int(time.time() * 1000)) % 30000
        sockets = []
        try:
            for offset in range(len(SERVICES)):
                s = socket.socket()
                s.bind(("127.0.0.1", base + offset))
                sockets.append(s)
            return base
        except OSError:
            time.sleep(0.01)
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free port range")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapter-root")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, adapter_root):
    spec = ClusterSpec(
        base_port=_free_base_port(),
        adapter_root=adapter_root,
        log_dir=tmp_path_factory.mktemp("logs"),
        extra_args={
            "adapters": ["--db", str(tmp_path_factory.mktemp("registry") / "catalog.sqlite3")],  # not the user's home
            "vision": ["--max-image-bytes", str(VISION_MAX_BYTES)],
            "decoder": ["--max-model-len", str(DECODER_MAX_MODEL_LEN)],
        },
        http_port=free_port(),
        log_format="json",  # tests/e2e/test_logs.py parses every line the session's requests logged
    )
    with Cluster(spec) as running:
        yield running


@pytest.fixture(scope="session")
def gateway_address(cluster) -> str:
    return cluster.spec.address("gateway")


@pytest.fixture(scope="session")
def http_url(cluster) -> str:
    """The gateway's HTTP API (services/gateway/http/), e.g. http://127.0.0.1:PORT."""
    return f"http://{cluster.spec.host}:{cluster.spec.http_port}"


@pytest.fixture(scope="session")
def gateway(gateway_address):
    with grpc.insecure_channel(gateway_address, options=CHANNEL_OPTIONS) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


@pytest.fixture
def assert_healthy(cluster):
    """After a refusal: every service still answers its health check with SERVING."""

    def check():
        for service in cluster.spec.services():
            assert cluster.processes[service].poll() is None, f"{service} died:\n{cluster.log_tail(service)}"
            with grpc.insecure_channel(cluster.spec.address(service)) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, service

    return check


@pytest.fixture(scope="session")
def hf_decoder():
    """transformers' own model and tokenizer for the same checkpoint: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = default_decoder_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def embedding_dir() -> Path:
    return default_embedding_dir()


class _SendToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the cluster's internal token to every call of a (synchronous) channel."""

    def __init__(self, token: str):
        self._entry = (INTERNAL_TOKEN_METADATA, token)

    def _details(self, details):
        return _CallDetails(details.method, details.timeout, [*(details.metadata or ()), self._entry],
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


class _CallDetails(namedtuple("_CallDetails", "method timeout metadata credentials wait_for_ready compression"),
                   grpc.ClientCallDetails):
    pass


def internal_token(cluster) -> str:
    return Path(cluster.token_file).read_text().strip()


def internal_channel(cluster, service: str) -> grpc.Channel:
    """A channel to one service's own (internal) port that sends the cluster's internal token."""
    channel = grpc.insecure_channel(cluster.spec.address(service), options=CHANNEL_OPTIONS)
    return grpc.intercept_channel(channel, _SendToken(internal_token(cluster)))


def once_back(call, timeout_s: float = 15.0):
    """`call()`'s answer once a restarted or resumed service is back: UNAVAILABLE is retried for
    `timeout_s` (the gateway's channels reconnect within their 2 s max backoff), anything else raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def embed_once_back(gateway, timeout_s: float = 15.0):
    """An Embed through the gateway once a restarted pooler is back (`once_back`)."""
    return once_back(lambda: gateway.Embed(pooling_pb2.EmbedRequest(inputs=["back"]), timeout=30), timeout_s)


def run_cli(address: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera.cli.main", *args, "--address", address],
                          capture_output=True, text=True, timeout=timeout)
