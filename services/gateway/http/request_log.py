"""One log line per HTTP request, and its `X-Request-Id`.

The id is the caller's `X-Request-Id` header or a fresh one (services/common/logs.py); every
answer carries it back in `X-Request-Id`, and every downstream call the core makes for the route
sends it on as `x-request-id` metadata, so the decoder's line and this one share it.
"""

from __future__ import annotations

import logging
import time

from services.common import logs

HEADER = b"x-request-id"
QUIET_PATHS = ("/health", "/ping", "/metrics")  # probes and scrapes: DEBUG

log = logging.getLogger("tessera.requests.http")


class RequestLog:
    """ASGI middleware: takes or makes the request id, sets `X-Request-Id` on the answer, and logs
    request_id, method, route (the path), status and latency_ms when the answer is sent (a
    streamed answer: when its last chunk is). A request whose app raised logs status 500."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        caller_id = dict(scope["headers"]).get(HEADER, b"").decode("latin-1")
        request_id = logs.use_request_id(caller_id)
        started = time.perf_counter()
        status = 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (HEADER, request_id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope["path"]
            probe = path.startswith(QUIET_PATHS) or (path == "/" and scope["method"] == "GET")  # TEI's health
            level = logging.DEBUG if probe else logging.INFO
            latency_ms = round((time.perf_counter() - started) * 1000, 1)
            log.log(level, "%s %s %d %.1f ms", scope["method"], path, status, latency_ms,
                    extra={"request_id": request_id, "method": scope["method"], "route": path, "status": status,
                           "latency_ms": latency_ms})
