"""Health an operator can route on: /health is 200 while the gateway can serve its core traffic
(a decoder replica; a pooler in a deployment without decoders), naming every dependency that is
down; /health/generate and /health/embed answer per capability; the gRPC port's named statuses
follow the same rule. The dependencies are real grpc.health.v1 servers on loopback, whose
statuses the tests set; the cluster itself: tests/e2e/test_replicas.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.gateway import readiness
from services.gateway.http.app import create_app
from services.gateway.http.backend import Backend
from services.gateway.readiness import Readiness
from tessera.v1 import gateway_pb2

from .test_http_app import call

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Dependency:
    """One grpc.health.v1 server on a loopback port (a registry, a decoder or pooler replica)."""

    def __init__(self) -> None:
        self.server = grpc.aio.server()
        self.status = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.status, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def set(self, status) -> None:
        await self.status.set("", status)


class ClusterCore:
    """A core whose GetInfo lists `replicas` ((service, address) pairs), as the gateway's does."""

    def __init__(self, replicas: list[tuple[str, str]]) -> None:
        self.replicas = replicas

    async def info(self, call):
        return gateway_pb2.ClusterInfo(replicas=[gateway_pb2.ReplicaInfo(service=s, address=a)
                                                 for s, a in self.replicas])


class Cluster:
    """Two decoders, a pooler and a registry (all SERVING) behind the HTTP app, on one event loop."""

    def __init__(self, has_decoders: bool = True, num_decoders: int = 2) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)  # grpc.aio servers take the current loop when made
        self.decoders = [Dependency() for _ in range(num_decoders)]
        self.pooler, self.registry = Dependency(), Dependency()
        self.everything = [*self.decoders, self.pooler, self.registry]
        for dependency in self.everything:
            self.loop.run_until_complete(dependency.server.start())
        replicas = [("decoder", d.address) for d in self.decoders] + [("pooling", self.pooler.address)]
        self.backend = Backend(ClusterCore(replicas), {"adapters": self.registry.address},
                               has_decoders=lambda: has_decoders)
        self.asgi = create_app(self.backend, max_body_bytes=4096)

    def set(self, dependency: Dependency, status) -> None:
        self.loop.run_until_complete(dependency.set(status))

    def stop(self, dependency: Dependency) -> None:
        self.loop.run_until_complete(dependency.server.stop(None))

    def get(self, path: str) -> tuple[int, dict]:
        return call(self, path, None)

    def close(self) -> None:
        self.loop.run_until_complete(self.backend.close())
        for dependency in self.everything:
            self.loop.run_until_complete(dependency.server.stop(None))
        asyncio.set_event_loop(None)
        self.loop.close()


@pytest.fixture
def cluster():
    running = Cluster()
    yield running
    running.close()


def test_all_serving_is_ok_on_every_route(cluster):
    for path in ("/health", "/health/generate", "/health/embed", "/ping", "/"):
        status, answer = cluster.get(path)
        assert (status, answer["status"], answer["not_serving"], answer["degraded"]) == (200, "ok", [], []), path
        assert answer["serving"] == {"generate": True, "embed": True}
    assert cluster.get("/health/live") == (200, {"status": "ok"})


def test_a_registry_that_is_down_degrades_and_leaves_the_gateway_ready(cluster):
    """Chat and embeddings still answer without the registry: 200 "degraded", naming it."""
    cluster.stop(cluster.registry)
    for path in ("/health", "/health/generate", "/health/embed"):
        status, answer = cluster.get(path)
        assert (status, answer["status"]) == (200, "degraded"), (path, answer)
        [problem] = answer["not_serving"]
        assert problem.startswith("adapters: ") and cluster.registry.address in problem, problem


def test_one_of_two_decoders_down_is_degraded_and_none_left_is_503(cluster):
    first, second = cluster.decoders
    cluster.set(first, NOT_SERVING)
    status, answer = cluster.get("/health")
    assert (status, answer["status"], answer["not_serving"]) == (200, "degraded", []), answer
    assert answer["degraded"] == [f"decoder replica {first.address}: {first.address} NOT_SERVING"]
    cluster.stop(second)
    status, answer = cluster.get("/health")
    assert (status, answer["status"]) == (503, "unavailable"), answer
    [problem] = answer["not_serving"]
    assert problem.startswith("decoder: "), problem
    assert answer["serving"] == {"generate": False, "embed": True}
    assert cluster.get("/health/generate")[0] == 503
    status, answer = cluster.get("/health/embed")  # the pooler still serves: a balancer routing embeddings keeps it
    assert (status, answer["status"]) == (200, "degraded"), answer
    assert cluster.get("/health/live")[0] == 200  # the process itself is fine: no restart


def test_without_decoders_the_poolers_are_the_core():
    """A pooling-only deployment (no decoder replica has ever served): /health follows the pooler."""
    cluster = Cluster(has_decoders=False, num_decoders=1)
    try:
        cluster.stop(cluster.decoders[0])
        status, answer = cluster.get("/health")
        assert (status, answer["status"], answer["serving"]) == (200, "degraded", {"generate": False, "embed": True})
        assert cluster.get("/health/generate")[0] == 503
        cluster.set(cluster.pooler, NOT_SERVING)
        assert cluster.get("/health")[0] == 503
    finally:
        cluster.close()


def test_the_readiness_rule():
    down = Readiness(gateway=None, generate=False, embed=True, has_decoders=True)
    assert (down.ready(), down.ready("generate"), down.ready("embed")) == (False, False, True)
    pooling_only = Readiness(gateway=None, generate=False, embed=True, has_decoders=False)
    assert (pooling_only.core, pooling_only.ready()) == ("embed", True)
    draining = Readiness(gateway="NOT_SERVING", generate=True, embed=True, has_decoders=True)
    assert not any(draining.ready(c) for c in (None, "generate", "embed"))
    with pytest.raises(ValueError, match="capability must be one of"):
        down.ready("rerank")


def _pools(decoders_ready: bool, poolers_ready: bool, ever: bool):
    def pool(ready: bool, ever_ready: bool):
        return SimpleNamespace(replicas=SimpleNamespace(ready=lambda: ["r"] if ready else [], ever_ready=ever_ready))

    return SimpleNamespace(decoders=pool(decoders_ready, ever), poolers=pool(poolers_ready, poolers_ready))


def test_grpc_statuses_follow_the_replicas_and_the_gateways_own():
    """tessera.v1.Gateway/{ready,generate,embed} on the gateway's health servicer, as `follow` sets them."""

    async def statuses(core, own) -> dict[str, int]:
        servicer = health.aio.HealthServicer()
        await readiness.register(servicer)
        await servicer.set("", own)
        follower = asyncio.ensure_future(readiness.follow(core, servicer, poll_s=0.01))
        await asyncio.sleep(0.05)
        follower.cancel()
        return {name: (await servicer.Check(health_pb2.HealthCheckRequest(service=name), None)).status
                for name in readiness.HEALTH_SERVICES.values()}

    ready, generate, embed = readiness.HEALTH_SERVICES.values()
    no_decoder_left = asyncio.run(statuses(_pools(False, True, ever=True), SERVING))
    assert no_decoder_left == {ready: NOT_SERVING, generate: NOT_SERVING, embed: SERVING}
    serving = asyncio.run(statuses(_pools(True, False, ever=True), SERVING))
    assert serving == {ready: SERVING, generate: SERVING, embed: NOT_SERVING}
    draining = asyncio.run(statuses(_pools(True, True, ever=True), NOT_SERVING))
    assert set(draining.values()) == {NOT_SERVING}
