"""The gateway's OpenAI-compatible HTTP API (FastAPI on uvicorn, in the gateway's process and loop).

`http_server(config, core, ...)` builds it from the gateway's config; the routes call the same
in-process core as the gRPC servicer (services/gateway/core.py), so the HTTP door adds shapes, not
behaviour.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from services.gateway.api_keys import read_api_keys
from services.gateway.config import GatewayConfig
from services.gateway.http.app import create_app
from services.gateway.http.backend import Backend
from services.gateway.http.server import HttpServer

# A JSON body carries images as base64 (4/3 of their bytes) plus quoting: twice the gRPC limit
# lets every request the gRPC port accepts through, and refuses with 413 what it never could.
BODY_BYTES_PER_GRPC_BYTE = 2


def http_server(config: GatewayConfig, core, max_grpc_bytes: int,
                gateway_health: Callable[[], Awaitable[str | None]] | None = None,
                extra_routes: Mapping[str, object] = (), tls: tuple[Path, Path] | None = None) -> HttpServer:
    """The HTTP server for `config.http_port` on the host of `config.address`, over `core`.

    `max_grpc_bytes`: the gRPC port's message limit (a request past it is refused alike);
    `gateway_health`: the gateway's own health verdict (backend.health_of); `extra_routes`: more
    ASGI apps by path (/metrics); `tls`: (certificate chain, private key) PEM files: HTTPS, with the
    gRPC port's certificate.

    Raises:
        ValueError: `config.api_key_file` is set but unreadable or empty.
    """
    keys = read_api_keys(config.api_key_file) if config.api_key_file else frozenset()
    services = {"adapters": config.adapters, **({"vision": config.vision} if config.vision else {}),
                "decoder": config.decoder, "pooling": config.pooling}
    backend = Backend(core, services, keys, max_request_bytes=max_grpc_bytes,
                      has_decoders=lambda: core.decoders.replicas.ever_ready,
                      **({"gateway_health": gateway_health} if gateway_health else {}))
    app = create_app(backend, max_grpc_bytes * BODY_BYTES_PER_GRPC_BYTE, extra_routes,
                     return_tokens_as_token_ids=config.return_tokens_as_token_ids)
    host = config.address.rpartition(":")[0]
    return HttpServer(app, host, config.http_port, on_stop=backend.close, tls=tls)
