"""Run a service's `serve(...)` in this process, as its `__main__` does, and watch its health.

The engine, batcher or encoder then lives in the test's process, where a test can make one of its
collaborators fail; the server, health task and shutdown are the production ones (SIGTERM stops it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.launch import free_port
from services.common.server import Hooks, insecure_channel, serve

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@contextlib.asynccontextmanager
async def serving(name: str, register: Callable[[grpc.aio.Server], list[str]], health: Callable[[], str | None],
                  start: Callable[[], Awaitable[None]] | None = None,
                  stop: Callable[[], Awaitable[None]] | None = None,
                  address: str | None = None) -> AsyncIterator[grpc.aio.Channel]:
    """`serve(...)` on `address` (default: a free port) until the block ends; yields a channel once
    health says SERVING."""
    before = signal.getsignal(signal.SIGTERM)
    address = address or f"127.0.0.1:{free_port()}"
    task = asyncio.create_task(serve(name, address, register, Hooks(start, stop, health)))
    async with insecure_channel(address) as channel:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            # SERVING, and serve's SIGTERM handler in place (it is set right after)
            while signal.getsignal(signal.SIGTERM) is before:
                assert not task.done(), task.exception()
                assert time.monotonic() < deadline, f"{name} not SERVING within 60 s"
                await asyncio.sleep(0.05)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == SERVING
            yield channel
        finally:
            if not task.done():
                os.kill(os.getpid(), signal.SIGTERM)  # the production shutdown path: drain, then stop
            await asyncio.wait_for(task, 30)


class WatchedHealth:
    """Every status a health Watch streams for `service`, with its arrival time (monotonic s)."""

    def __init__(self, channel: grpc.aio.Channel, service: str = "") -> None:
        self.statuses: list[tuple[int, float]] = []
        self._call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service))
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for reply in self._call:
                self.statuses.append((reply.status, time.monotonic()))
        except grpc.aio.AioRpcError:  # the server stopped or the watch was cancelled: no more statuses
            pass

    async def wait_for(self, status: int, timeout_s: float) -> float:
        """When `status` arrived; raises TimeoutError if it does not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for got, at in self.statuses:
                if got == status:
                    return at
            await asyncio.sleep(0.02)
        raise TimeoutError(f"no {health_pb2.HealthCheckResponse.ServingStatus.Name(status)} within {timeout_s} s; "
                           f"got {self.statuses}")

    def close(self) -> None:
        self._call.cancel()
        self._task.cancel()
