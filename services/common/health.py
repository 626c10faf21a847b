"""grpc.health.v1 for every service: Check, and a Watch that ends when the server drains.

The API of grpcio-health-checking's asyncio servicer (`set`, `enter_graceful_shutdown`, `Check`,
`Watch`), with one difference: at graceful shutdown each open Watch sends NOT_SERVING and then
ends its stream (status OK), and a Watch opened afterwards does the same at once. The library's
Watch waits for a change that never comes, so `server.stop(grace)` waits out the whole grace
for it and then cancels it, which grpc logs as an ERROR with CancelledError tracebacks.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):
    """The statuses of a server's services ("" = the server as a whole, SERVING from the start)."""

    def __init__(self) -> None:
        self._statuses: dict[str, int] = {"": SERVING}
        self._changed = asyncio.Condition()  # notified on every status change and at shutdown
        self._shutting_down = False

    async def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
        """The service's status; NOT_FOUND for a service never set (`context` may be None for "",
        which is always set: the gateway's HTTP /health asks in-process)."""
        status = self._statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        """The service's status now and at every change (SERVICE_UNKNOWN while never set), until
        graceful shutdown: then NOT_SERVING and the stream ends."""
        sent = None
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda last=sent: self._status(request.service) != last
                                             or self._shutting_down)
                status, ending = self._status(request.service), self._shutting_down
            if status != sent:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                sent = status
            if ending:
                return

    async def set(self, service: str, status: int) -> None:
        """Set `service`'s status (ignored from graceful shutdown on)."""
        if self._shutting_down:
            return
        async with self._changed:
            self._statuses[service] = status
            self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Every status NOT_SERVING for good; open Watch streams send it and end."""
        async with self._changed:
            self._shutting_down = True
            self._statuses = dict.fromkeys(self._statuses, NOT_SERVING)
            self._changed.notify_all()

    def _status(self, service: str) -> int:
        return self._statuses.get(service, SERVICE_UNKNOWN)
