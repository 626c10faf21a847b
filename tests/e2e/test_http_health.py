"""/health names a stopped dependency, and API keys guard the inference routes (HTTP and gRPC).

A second gateway (HTTP on, API keys on) shares the session cluster's decoder, pooling and vision
but has an adapter registry of its own, which the test stops and starts without disturbing the
shared cluster.
"""

from __future__ import annotations

import time

import grpc
import openai
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import INTERNAL_TOKEN_FILE_ENV
from services.common.launch import ServiceProcess
from tessera.v1 import gateway_pb2

from .conftest import free_port

API_KEY = "test-key-1"


@pytest.fixture(scope="module")
def keyed_gateway(cluster, tmp_path_factory):
    """(registry process, HTTP url, gRPC address) of a gateway with its own registry and an API key file."""
    spec = cluster.spec
    tmp_path = tmp_path_factory.mktemp("keyed-gateway")
    keys = tmp_path / "api-keys"
    keys.write_text(f"# one key a line\n{API_KEY}\n")
    (tmp_path / "root").mkdir()
    env = {INTERNAL_TOKEN_FILE_ENV: str(cluster.token_file)}
    registry = ServiceProcess("services.adapters", ["--root", str(tmp_path / "root"), "--base-model-dir",
                                                    str(spec.decoder_model_dir)], env=env)
    http_port = free_port()
    gateway = ServiceProcess("services.gateway", [
        "--decoder", spec.address("decoder"), "--pooling", spec.address("pooling"), "--adapters", registry.address,
        "--vision", spec.address("vision"), "--http-port", str(http_port)],
        env={**env, "TESSERA_API_KEY_FILE": str(keys)})  # keys by path in the environment, never argv
    with registry, gateway:
        yield registry, f"http://127.0.0.1:{http_port}", gateway.address


def _health_becomes(url: str, status: str, timeout_s: float = 20.0) -> requests.Response:
    """/health once its body's status is `status` (or the last answer after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = requests.get(f"{url}/health", timeout=30)
        if response.json()["status"] == status or time.monotonic() > deadline:
            return response
        time.sleep(0.25)


def test_health_names_a_stopped_registry_and_stays_200(keyed_gateway):
    """Without its registry the gateway still serves chat and embeddings: 200 "degraded", naming it."""
    registry, url, _ = keyed_gateway
    healthy = _health_becomes(url, "ok")
    assert healthy.status_code == 200 and healthy.json() == {
        "status": "ok", "not_serving": [], "degraded": [], "serving": {"generate": True, "embed": True}}, healthy.text
    registry.stop()
    down = _health_becomes(url, "degraded")
    assert down.status_code == 200, down.text
    [problem] = down.json()["not_serving"]
    assert problem.startswith("adapters:") and registry.address in problem
    registry.start()  # the same address again
    back = _health_becomes(url, "ok")
    assert back.status_code == 200, back.text


def test_api_keys_guard_inference_routes(keyed_gateway, gateway):
    embedding_model = gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30).pooling.model
    _, url, _ = keyed_gateway
    for key in (None, "wrong-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        refused = requests.post(f"{url}/v1/embeddings", json={"model": "m", "input": "x"}, headers=headers, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-key", max_retries=0) as wrong, \
            pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as sdk:
        assert embedding_model in {m.id for m in sdk.models.list().data}
        assert len(sdk.embeddings.create(model=embedding_model, input="x").data[0].embedding) > 0
    assert requests.get(f"{url}/health", timeout=30).status_code == 200  # probes send no key


def test_api_keys_guard_the_grpc_port_too(keyed_gateway, gateway):
    """The same keys on the gateway's gRPC port: no key or a wrong one is UNAUTHENTICATED, the right
    one (tessera.client's api_token) is served; health stays open for probes."""
    from tessera.client import Client, Unauthenticated

    embedding_model = gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30).pooling.model
    _, _, address = keyed_gateway
    for token in ("", "wrong-key"):
        with Client(address, api_token=token) as client, pytest.raises(Unauthenticated):
            client.embed(["x"], model=embedding_model)
    with Client(address, api_token=API_KEY) as client:
        assert client.embed(["x"], model=embedding_model).embeddings.shape[0] == 1
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
    assert status == health_pb2.HealthCheckResponse.SERVING
