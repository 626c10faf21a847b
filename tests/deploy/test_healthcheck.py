"""`python -m services.common.healthcheck`: the probe the image ships, against real gRPC servers."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.launch import REPO, free_port


def probe(*args: str, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python_flags, "-m", "services.common.healthcheck", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=30)


def test_serving_service_exits_zero_silently(pooling_service):
    for service in ("", "tessera.v1.Pooling"):
        result = probe(pooling_service.address, service)
        assert (result.returncode, result.stderr) == (0, ""), result.stderr


def test_unknown_service_name_is_one_line_naming_the_status(pooling_service):
    result = probe(pooling_service.address, "tessera.v1.Nope")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "NOT_FOUND" in result.stderr and "tessera.v1.Nope" in result.stderr


def test_nothing_listening_fails_within_the_deadline():
    address = f"127.0.0.1:{free_port()}"
    result = probe(address, "--timeout", "1")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and address in result.stderr
    assert "UNAVAILABLE" in result.stderr or "DEADLINE_EXCEEDED" in result.stderr


@pytest.fixture
def not_serving_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_not_serving_exits_one(not_serving_server):
    result = probe(not_serving_server)
    assert result.returncode == 1 and "NOT_SERVING" in result.stderr and result.stderr.count("\n") == 1


def test_probe_never_imports_torch(pooling_service):
    # -X importtime lists every module the interpreter imported, on stderr, one per line
    result = probe(pooling_service.address, python_flags=("-X", "importtime"))
    assert result.returncode == 0, result.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "grpc_health.v1.health_pb2" in imported
    assert not {name for name in imported if name.split(".")[0] in ("torch", "numpy", "transformers")}


def test_a_ca_file_without_a_certificate_is_one_line(tmp_path):
    not_pem = tmp_path / "key.pem"
    not_pem.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    result = probe(f"127.0.0.1:{free_port()}", "--tls-ca-file", str(not_pem))
    assert result.returncode == 2 and "holds no PEM certificate" in result.stderr
    assert probe(f"127.0.0.1:{free_port()}", "--tls-server-name", "x").returncode == 2  # needs --tls-ca-file
