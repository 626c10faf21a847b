"""Service security settings: the internal token file is read once and required when named; the
gateway's public port can serve TLS. (The cluster's internal ports: tests/e2e/test_internal_auth.py.)"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import auth
from services.common.launch import REPO, free_port
from services.common.server import create_server, insecure_channel
from tessera import protocol
from tessera.rich_status import error_info_of


@pytest.fixture
def process_token():
    """Restore the process-wide token after a test that configures one."""
    yield
    auth.use_internal_token(None)


def test_token_file_is_read_and_configures_the_process(tmp_path, monkeypatch, process_token):
    monkeypatch.delenv(auth.INTERNAL_TOKEN_FILE_ENV, raising=False)
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    security = auth.configure_security(["--internal-token-file", str(path), "--other-flag", "x"])
    assert security.internal_token == "s3cret-token" and auth.internal_token() == "s3cret-token"
    assert "s3cret" not in repr(security)
    assert len(auth.client_interceptors()) == 4 and len(auth.server_interceptors(public=False)) == 1
    assert auth.server_interceptors(public=True) == []


def test_environment_names_the_token_file(tmp_path, monkeypatch, process_token):
    path = tmp_path / "token"
    path.write_text("from-env")
    monkeypatch.setenv(auth.INTERNAL_TOKEN_FILE_ENV, str(path))
    assert auth.configure_security([]).internal_token == "from-env"


def test_no_token_means_auth_off(monkeypatch, process_token):
    monkeypatch.delenv(auth.INTERNAL_TOKEN_FILE_ENV, raising=False)
    assert auth.configure_security([]).internal_token is None
    assert auth.client_interceptors() == [] and auth.server_interceptors(public=False) == []


@pytest.mark.parametrize("content", [None, "", "  \n"], ids=["missing", "empty", "blank"])
def test_named_token_file_must_hold_a_token(tmp_path, content, process_token):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as error:
        auth.configure_security(["--internal-token-file", str(path)])
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_service_refuses_to_start_with_a_missing_token_file(tmp_path):
    missing = tmp_path / "nope"
    result = subprocess.run([sys.executable, "-m", "services.gateway", "--address", f"127.0.0.1:{free_port()}",
                             "--internal-token-file", str(missing)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == f"internal token file {missing}: No such file or directory"


def test_written_token_file_is_private(tmp_path):
    path = auth.write_token_file(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(path.read_text()) >= 32 and path.read_text() != auth.write_token_file(tmp_path).read_text()


def _self_signed(directory: Path, names: tuple[str, ...] = ("localhost", "127.0.0.1")) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([_general_name(x509, n) for n in names]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def _general_name(x509, name: str):
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _wait_serving(address: str, credentials, process, log: Path, options=()) -> None:
    with grpc.secure_channel(address, credentials, options=list(options)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)


def test_a_tls_gateway_serves_https_and_its_http_door_reaches_its_grpc_port(tmp_path):
    """A certificate that names the public host only (not 127.0.0.1): HTTP is HTTPS with it, the
    HTTP routes reach the gateway's core in process (no socket to its own gRPC port, so the
    certificate needs no loopback name), and the image's healthcheck probes it with --tls-ca-file
    and --tls-server-name."""
    import http.client
    import json
    import ssl

    cert_file, key_file = _self_signed(tmp_path, names=("gateway.example",))
    address, http_port = f"127.0.0.1:{free_port()}", free_port()
    unused = f"127.0.0.1:{free_port()}"
    log = tmp_path / "gateway.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.gateway", "--address", address, "--decoder", unused, "--pooling", unused,
             "--adapters", unused, "--vision", "", "--http-port", str(http_port),
             "--tls-cert-file", str(cert_file), "--tls-key-file", str(key_file)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert_file.read_bytes())
        _wait_serving(address, credentials, process, log, [("grpc.ssl_target_name_override", "gateway.example")])
        context = ssl.create_default_context(cafile=str(cert_file))
        context.check_hostname = False  # 127.0.0.1 is not the certificate's name; its chain is still verified
        connection = http.client.HTTPSConnection("127.0.0.1", http_port, context=context, timeout=30)
        connection.request("GET", "/health")
        reply = connection.getresponse()
        health = json.loads(reply.read())
        assert reply.status == 503 and health["not_serving"], health  # nothing behind the gateway
        assert not [p for p in health["not_serving"] if p.startswith("gateway")], health  # the door reaches the core
        with pytest.raises((ConnectionError, http.client.HTTPException)):  # no plaintext HTTP on that port
            plain = http.client.HTTPConnection("127.0.0.1", http_port, timeout=10)
            plain.request("GET", "/health")
            plain.getresponse().read()

        def probe(*flags: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "services.common.healthcheck", address, "tessera.v1.Gateway",
                                   *flags], cwd=REPO, capture_output=True, text=True, timeout=60)

        assert probe("--tls-ca-file", str(cert_file), "--tls-server-name", "gateway.example").returncode == 0
        wrong_name = probe("--tls-ca-file", str(cert_file))
        assert wrong_name.returncode == 1 and "UNAVAILABLE" in wrong_name.stderr
        assert probe().returncode == 1  # plaintext against a TLS port
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_tls_gateway_whose_http_port_is_taken_exits_1_in_one_line(tmp_path):
    import socket

    cert_file, key_file = _self_signed(tmp_path, names=("gateway.example",))
    unused = f"127.0.0.1:{free_port()}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run(
            [sys.executable, "-m", "services.gateway", "--address", f"127.0.0.1:{free_port()}", "--decoder", unused,
             "--pooling", unused, "--adapters", unused, "--vision", "", "--http-port", str(taken.getsockname()[1]),
             "--tls-cert-file", str(cert_file), "--tls-key-file", str(key_file)],
            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "http: cannot listen on" in done.stderr.strip().splitlines()[-1], done.stderr


def test_a_certificate_and_a_key_that_do_not_match_are_refused_in_one_line(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cert_file, _ = _self_signed(tmp_path / "a")
    _, other_key = _self_signed(tmp_path / "b")
    with pytest.raises(SystemExit, match="are not a PEM certificate chain and its private key"):
        auth.configure_security(["--tls-cert-file", str(cert_file), "--tls-key-file", str(other_key)], tls=True)


def test_gateway_serves_tls(tmp_path):
    cert_file, key_file = _self_signed(tmp_path)
    address = f"127.0.0.1:{free_port()}"
    unused = f"127.0.0.1:{free_port()}"  # no backends: the port's own answers are what is tested
    with (tmp_path / "gateway.log").open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.gateway", "--address", address, "--decoder", unused, "--pooling", unused,
             "--adapters", unused, "--vision", "", "--tls-cert-file", str(cert_file), "--tls-key-file", str(key_file)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert_file.read_bytes())
        _wait_serving(address, credentials, process, tmp_path / "gateway.log")
        with grpc.insecure_channel(address) as plaintext:
            with pytest.raises(grpc.RpcError) as error:
                health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        process.terminate()
        process.wait(timeout=30)


async def _echo_unary(request, context):
    return request


async def _echo_stream(request_iterator, context):
    async for request in request_iterator:
        yield request


def test_internal_port_refuses_every_call_kind_without_the_token(process_token):
    """All four call kinds, in process: missing and wrong token UNAUTHENTICATED with their reasons
    (the status's ErrorInfo), the right one served."""
    async def scenario() -> dict[str, list]:
        auth.use_internal_token("right-token")
        server = create_server()
        handlers = {
            "UU": grpc.unary_unary_rpc_method_handler(_echo_unary),
            "US": grpc.unary_stream_rpc_method_handler(_echo_one),
            "SU": grpc.stream_unary_rpc_method_handler(_first),
            "SS": grpc.stream_stream_rpc_method_handler(_echo_stream),
        }
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Echo", handlers)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        results = {}
        try:
            for label, metadata in (("missing", ()), ("wrong", ((auth.INTERNAL_TOKEN_METADATA, "wrong-token"),))):
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    results[label] = [await _code(_invoke(channel, kind, metadata)) for kind in handlers]
            async with insecure_channel(f"127.0.0.1:{port}") as channel:  # sends the process's token
                results["right"] = [await _invoke(channel, kind, ()) for kind in handlers]
        finally:
            await server.stop(0)
        return results

    results = asyncio.run(scenario())
    assert results["missing"] == [(grpc.StatusCode.UNAUTHENTICATED, protocol.INTERNAL_TOKEN_MISSING)] * 4
    assert results["wrong"] == [(grpc.StatusCode.UNAUTHENTICATED, protocol.INTERNAL_TOKEN_WRONG)] * 4
    assert results["right"] == [b"x"] * 4


async def _echo_one(request, context):
    yield request


async def _first(request_iterator, context):
    async for request in request_iterator:
        return request


async def _invoke(channel, kind: str, metadata) -> bytes:
    method = f"/t.Echo/{kind}"
    if kind == "UU":
        return await channel.unary_unary(method)(b"x", metadata=metadata, timeout=10)
    if kind == "US":
        return b"".join([r async for r in channel.unary_stream(method)(b"x", metadata=metadata, timeout=10)])
    if kind == "SU":
        return await channel.stream_unary(method)(iter([b"x"]), metadata=metadata, timeout=10)
    return b"".join([r async for r in channel.stream_stream(method)(iter([b"x"]), metadata=metadata, timeout=10)])


async def _code(call) -> tuple[grpc.StatusCode, str]:
    """The call's status and the reason its ErrorInfo gives."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        info = error_info_of(error)
        return error.code(), info.reason if info else ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("placeholder", ["replace-me-in-an-overlay", "REPLACE-ME-IN-AN-OVERLAY\n", "changeme"])
def test_a_placeholder_token_is_refused(tmp_path, placeholder, process_token):
    path = tmp_path / "token"
    path.write_text(placeholder)
    with pytest.raises(SystemExit) as error:
        auth.configure_security(["--internal-token-file", str(path)])
    message = str(error.value)
    assert str(path) in message and "placeholder" in message and "\n" not in message


def test_a_service_with_the_deploy_placeholder_token_exits_1_in_one_line(tmp_path):
    """The value the Kubernetes base once shipped (`token: replace-me-in-an-overlay`)."""
    path = tmp_path / "internal-token"
    path.write_text("replace-me-in-an-overlay\n")
    result = subprocess.run([sys.executable, "-m", "services.gateway", "--address", f"127.0.0.1:{free_port()}"],
                            cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, auth.INTERNAL_TOKEN_FILE_ENV: str(path)})
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"internal token file {path} holds the placeholder 'replace-me-in-an-overlay'"), line


def test_placeholder_api_keys_and_admin_tokens_are_refused(tmp_path, monkeypatch):
    from services.adapters.config import RegistryConfig
    from services.gateway.api_keys import read_api_keys

    keys = tmp_path / "api-keys"
    keys.write_text("# one key a line\nreal-key-0123456789\nreplace-me\n")
    with pytest.raises(ValueError, match=f"api key file {keys} holds the placeholder 'replace-me'"):
        read_api_keys(str(keys))
    admin = tmp_path / "admin-token"
    admin.write_text("changeme\n")
    monkeypatch.delenv(protocol.ADMIN_TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match=f"admin token file {admin} holds the placeholder 'changeme'"):
        RegistryConfig(root=tmp_path / "adapters", admin_token_file=admin)
    monkeypatch.setenv(protocol.ADMIN_TOKEN_ENV, "replace-me-in-an-overlay")
    with pytest.raises(ValueError, match=r"\$TESSERA_ADMIN_TOKEN holds the placeholder"):
        RegistryConfig(root=tmp_path / "adapters")
