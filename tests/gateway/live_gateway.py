"""A real decoder (a tiny seeded checkpoint) and the real gateway core with its HTTP app, on one
event loop in a background thread, over real sockets: for tests that drive the HTTP API with the
official `openai` SDK (sync clients, from the test's own thread)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.request
from pathlib import Path

from services.common.server import create_server
from services.decoder.config import DecoderConfig
from services.decoder.engine import LLMEngine
from services.decoder.servicer import DecoderServicer
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.http.app import create_app
from services.gateway.http.backend import Backend
from services.gateway.http.server import HttpServer
from tessera.v1 import decoder_pb2_grpc

NOTHING = "127.0.0.1:1"  # pooling and adapters: none served
READY_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveGateway:
    """`with LiveGateway(model_dir, **decoder_options) as live:` serves the HTTP API at `live.url`
    (its /v1 answers once the decoder has reported); the decoder's own port is `decoder_address`."""

    def __init__(self, model_dir: Path, **decoder_options) -> None:
        self.config = DecoderConfig(model_dir=str(model_dir), **decoder_options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="live-gateway")

    def __enter__(self) -> LiveGateway:
        self._thread.start()
        deadline = time.monotonic() + READY_S
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                pass
            if self._failure is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the live gateway did not start: {self._failure!r}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as error:  # reported to the waiting test
            self._failure = error
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        servicer = DecoderServicer(LLMEngine(self.config))
        server = create_server()
        decoder_pb2_grpc.add_DecoderServicer_to_server(servicer, server)
        decoder_port = server.add_insecure_port("127.0.0.1:0")
        self.decoder_address = f"127.0.0.1:{decoder_port}"
        await server.start()
        await servicer.engine.start()
        core = GatewayCore(GatewayConfig(address=NOTHING, decoder=f"127.0.0.1:{decoder_port}", pooling=NOTHING,
                                         adapters=NOTHING, vision=""))
        await core.start()
        http = HttpServer(create_app(Backend(core, {}), max_body_bytes=1 << 22), "127.0.0.1", self.port, grace_s=1)
        await http.start()
        try:
            await self._stop.wait()
        finally:
            await http.stop()
            await core.close()
            await server.stop(0)
            await servicer.engine.stop()
