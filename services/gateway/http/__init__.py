"""The gateway's OpenAI-compatible HTTP API (FastAPI on uvicorn, in the gateway's process and loop).

`http_server(config, ...)` builds it from the gateway's config; the routes call the gateway's own
public gRPC port over loopback (backend.py), so the HTTP door adds shapes, not behaviour.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from services.gateway.api_keys import read_api_keys
from services.gateway.config import GatewayConfig
from services.gateway.http.app import create_app
from services.gateway.http.backend import Backend, loopback_address
from services.gateway.http.server import HttpServer

# A JSON body carries images as base64 (4/3 of their bytes) plus quoting: twice the gRPC limit
# lets every request the gRPC port accepts through, and refuses with 413 what it never could.
BODY_BYTES_PER_GRPC_BYTE = 2


def http_server(config: GatewayConfig, max_grpc_bytes: int, loopback_target: str | None = None,
                extra_routes: Mapping[str, object] = (), loopback_key: str = "",
                tls: tuple[Path, Path] | None = None) -> HttpServer:
    """The HTTP server for `config.http_port` on the host of `config.address`.

    `loopback_target`: where the routes reach the gateway's gRPC API in plaintext (default: its
    port on loopback; with TLS, a local Unix socket, services/gateway/__main__.py). `extra_routes`:
    more ASGI apps by path (/metrics). `loopback_key`: sent to the gRPC port when it requires API
    keys (services/gateway/api_keys.py). `tls`: (certificate chain, private key) PEM files: HTTPS,
    with the gRPC port's certificate.

    Raises:
        ValueError: `config.api_key_file` is set but unreadable or empty.
    """
    keys = read_api_keys(config.api_key_file) if config.api_key_file else frozenset()
    services = {"adapters": config.adapters, **({"vision": config.vision} if config.vision else {}),
                "decoder": config.decoder, "pooling": config.pooling}
    backend = Backend(loopback_target or loopback_address(config.address), services, keys, loopback_key)
    app = create_app(backend, max_grpc_bytes * BODY_BYTES_PER_GRPC_BYTE, extra_routes,
                     return_tokens_as_token_ids=config.return_tokens_as_token_ids)
    host = config.address.rpartition(":")[0]
    return HttpServer(app, host, config.http_port, on_stop=backend.close, tls=tls)
