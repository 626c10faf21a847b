"""A service's start: health stays NOT_SERVING while `start` runs; a start that raises closes the
port, never says SERVING, and `exit_refused` turns the cause into one line on stderr, status 1."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.launch import free_port
from services.common.server import Hooks, exit_refused, insecure_channel, serve

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_failing_start_closes_the_port_without_ever_serving():
    address = f"127.0.0.1:{free_port()}"
    release = asyncio.Event()

    async def start() -> None:  # a model load whose warm-up finds the configuration cannot run
        await release.wait()
        raise ValueError("--attention-backend triton needs a CUDA device")

    async def main():
        task = asyncio.create_task(serve("svc", address, lambda server: [], Hooks(start=start)))
        async with insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            during = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10, wait_for_ready=True)
            release.set()
            with pytest.raises(ValueError, match="needs a CUDA device"):
                await task
            with pytest.raises(grpc.aio.AioRpcError) as after:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
        return during.status, after.value.code()

    during, after = asyncio.run(main())
    assert during == NOT_SERVING and after in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_exit_refused_writes_one_line_and_exits_1(capsys):
    with pytest.raises(SystemExit) as exited:
        exit_refused("decoder", ValueError("--device cuda needs a CUDA device;\n torch sees none"))
    assert exited.value.code == 1
    assert capsys.readouterr().err == "decoder: --device cuda needs a CUDA device; torch sees none\n"
    with pytest.raises(SystemExit):
        exit_refused("pooling", OSError("pooling: cannot listen on 127.0.0.1:1: port 1 is in use"))
    assert capsys.readouterr().err == "pooling: cannot listen on 127.0.0.1:1: port 1 is in use\n"
