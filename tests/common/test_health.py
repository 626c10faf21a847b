"""grpc.health.v1 as every service serves it (services/common/health.py): Check, Watch, and a clean
end of every open Watch when the server drains: no ERROR, no CancelledError traceback."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.health import HealthServicer
from services.common.launch import ServiceProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def test_a_service_stopped_with_an_open_watch_logs_no_error(tmp_path):
    """The reliability run's vision case, on the cheapest service: SIGTERM with a Watch open."""
    registry = ServiceProcess("services.adapters", ["--root", str(tmp_path)])
    with registry, grpc.insecure_channel(registry.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        assert next(watch).status == SERVING
        assert registry.stop() == 0
        rest = [reply.status for reply in watch]  # the stream ends (OK) rather than being cancelled
        assert watch.code() == grpc.StatusCode.OK
    assert rest == [NOT_SERVING]
    log = registry.log()
    assert "adapters stopped" in log, log
    for word in ("ERROR", "Traceback", "Exception", "CancelledError"):
        assert word not in log, log


def test_check_and_watch_follow_set_and_end_at_shutdown():
    async def scenario():
        servicer = HealthServicer()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as unknown:
                    await stub.Check(health_pb2.HealthCheckRequest(service="x"), timeout=10)
                watch = stub.Watch(health_pb2.HealthCheckRequest(service="x"), timeout=30)
                seen = [(await watch.read()).status]
                await servicer.set("x", NOT_SERVING)
                seen.append((await watch.read()).status)
                await servicer.set("x", SERVING)
                seen.append((await watch.read()).status)
                checked = (await stub.Check(health_pb2.HealthCheckRequest(service="x"), timeout=10)).status
                direct = (await servicer.Check(health_pb2.HealthCheckRequest(), None)).status  # in-process, no context
                await servicer.enter_graceful_shutdown()
                await servicer.set("x", SERVING)  # ignored from now on
                rest = []
                while (reply := await watch.read()) is not grpc.aio.EOF:
                    rest.append(reply.status)
                late = [reply.status async for reply in stub.Watch(health_pb2.HealthCheckRequest(), timeout=30)]
                return unknown.value.code(), seen, checked, direct, rest, await watch.code(), late
        finally:
            await server.stop(None)

    unknown, seen, checked, direct, rest, code, late = asyncio.run(scenario())
    assert unknown == grpc.StatusCode.NOT_FOUND
    assert seen == [SERVICE_UNKNOWN, NOT_SERVING, SERVING] and checked == SERVING and direct == SERVING
    assert rest == [NOT_SERVING] and code == grpc.StatusCode.OK
    assert late == [NOT_SERVING]  # a Watch opened while draining answers and ends at once
