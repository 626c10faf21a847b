"""uvicorn serving the HTTP app on the gateway's own asyncio loop, started and stopped by `serve`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path

import uvicorn

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """The gateway's `serve` owns SIGTERM/SIGINT (drain, then stop): uvicorn must not take them."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """`start()` binds host:port and serves `app` in a task; `stop()` closes it, letting requests in
    flight finish for up to `grace_s` seconds."""

    def __init__(self, app, host: str, port: int, grace_s: float = 5.0, on_stop=None,
                 tls: tuple[Path, Path] | None = None):
        """`tls`: (certificate chain, private key) PEM files: serve HTTPS."""
        # log_config=None: uvicorn's records go through the service's own handler (text or JSON,
        # services/common/logs.py); request lines come from request_log.py, not uvicorn's access log.
        cert, key = tls or (None, None)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, log_config=None,
                                lifespan="off", timeout_graceful_shutdown=grace_s,
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
