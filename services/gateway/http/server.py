"""uvicorn serving the HTTP app on the gateway's own asyncio loop, started and stopped by `serve`.

Connections are bounded as a production proxy bounds them: uvicorn's own settings for the idle
keep-alive time (`timeout_keep_alive`), the open connections and requests (`limit_concurrency`: 503
past it) and a request head's bytes (`h11_max_incomplete_event_size`: 400 past it); and, which
uvicorn lacks, a deadline for a request head (`header_timeout_s`, HeaderTimeoutH11): a connection
that sends nothing, or dribbles its request line and headers, is closed when it passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """The gateway's `serve` owns SIGTERM/SIGINT (drain, then stop): uvicorn must not take them."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head: `header_timeout_s` seconds from
    the connection's opening, or from the first bytes of its next request, until the request line
    and headers are in; past it the connection is closed. Between requests uvicorn's keep-alive
    timeout applies."""

    header_timeout_s = 20.0  # set per server by `with_header_timeout`

    def connection_made(self, transport) -> None:
        self._head_deadline = None
        super().connection_made(transport)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._head_deadline is None:  # a next request began on a kept-alive connection
                self._arm_head_deadline()
        else:  # the head is in (or the connection is done with)
            self._disarm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("http: closing a connection from %s whose request head was not in after %g s",
                     ":".join(map(str, self.client or ("?",))), self.header_timeout_s)
            self.transport.close()


def with_header_timeout(header_timeout_s: float) -> type[HeaderTimeoutH11]:
    """The h11 protocol class for a server whose request heads must be in within `header_timeout_s`."""
    return type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout_s": header_timeout_s})


class HttpServer:
    """`start()` binds host:port and serves `app` in a task; `stop()` closes it, letting requests in
    flight finish for up to `grace_s` seconds."""

    def __init__(self, app, host: str, port: int, grace_s: float = 5.0, on_stop=None,
                 tls: tuple[Path, Path] | None = None, timeout_keep_alive: float = 5.0,
                 header_timeout_s: float = 20.0, limit_concurrency: int | None = None,
                 h11_max_incomplete_event_size: int = 64 * 1024):
        """`tls`: (certificate chain, private key) PEM files: serve HTTPS. `timeout_keep_alive`,
        `header_timeout_s`: seconds (see the module's docstring); `limit_concurrency`: connections
        and requests before 503 (None: no cap); `h11_max_incomplete_event_size`: bytes of a head."""
        # log_config=None: uvicorn's records go through the service's own handler (text or JSON,
        # services/common/logs.py); request lines come from request_log.py, not uvicorn's access log.
        cert, key = tls or (None, None)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, log_config=None,
                                lifespan="off", timeout_graceful_shutdown=grace_s,
                                http=with_header_timeout(header_timeout_s), timeout_keep_alive=timeout_keep_alive,
                                limit_concurrency=limit_concurrency,
                                h11_max_incomplete_event_size=h11_max_incomplete_event_size,
                                ssl_certfile=str(cert) if cert else None, ssl_keyfile=str(key) if key else None)
        self.server = _Server(config)
        self._task: asyncio.Task | None = None
        self.host, self.port = host, port
        self._on_stop = on_stop  # awaited after the server closed (the backend's channels)

    async def start(self) -> None:
        """Serve in the background once bound.

        Raises:
            OSError: the port cannot be bound.
        """
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:  # bound here, not by uvicorn, which answers a busy port with sys.exit
            sock.bind((self.host.strip("[]"), self.port))
        except OSError as error:
            sock.close()
            raise OSError(f"http: cannot listen on {self.host}:{self.port}: {error.strerror}") from None
        self._task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started and not self._task.done():
            await asyncio.sleep(0.02)
        log.info("http serving on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        await self._task
        if self._on_stop is not None:
            await self._on_stop()
