"""The gateway's OpenAI-compatible HTTP API (FastAPI on uvicorn, in the gateway's process and loop).

`http_server(config, core, ...)` builds it from the gateway's config; the routes call the same
in-process core as the gRPC servicer (services/gateway/core.py), so the HTTP door adds shapes, not
behaviour.
"""

from __future__ import annotations

import resource
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from services.gateway.api_keys import read_api_keys
from services.gateway.config import GatewayConfig
from services.gateway.http.app import create_app
from services.gateway.http.backend import Backend
from services.gateway.http.body_limit import BodyBudget
from services.gateway.http.server import HttpServer

# A JSON body carries images as the same base64 data URIs as the Generate message, text with JSON's
# escapes (which only the text routes' own limit, body_limit.TEXT_BODY_BYTES, allows for): a chat
# body may be as large as the gRPC message it becomes, never larger than the gRPC port would take.
BODY_BYTES_PER_GRPC_BYTE = 1
BODY_BUDGET_PER_BODY_LIMIT = 2  # --max-body-bytes-in-flight 0: two largest chat bodies at once


def connection_cap(limit_concurrency: int) -> int:
    """uvicorn's limit_concurrency for `--limit-concurrency` (0: half the open-file soft limit, at
    least 64: the gRPC port, channels and files share the rest)."""
    if limit_concurrency:
        return limit_concurrency
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, (soft if soft != resource.RLIM_INFINITY else 65536) // 2)


def http_server(config: GatewayConfig, core, max_grpc_bytes: int,
                gateway_health: Callable[[], Awaitable[str | None]] | None = None,
                extra_routes: Mapping[str, object] = (), tls: tuple[Path, Path] | None = None) -> HttpServer:
    """The HTTP server for `config.http_port` on the host of `config.address`, over `core`.

    `max_grpc_bytes`: the gRPC port's message limit (a request past it is refused alike);
    `gateway_health`: the gateway's own health verdict (backend.health_of); `extra_routes`: more
    ASGI apps by path (/metrics); `tls`: (certificate chain, private key) PEM files: HTTPS, with the
    gRPC port's certificate.

    Bodies: the chat route's limit is `max_grpc_bytes` (BODY_BYTES_PER_GRPC_BYTE), the budget of
    bytes in flight `config.max_body_bytes_in_flight` (0: BODY_BUDGET_PER_BODY_LIMIT chat bodies);
    connections: `config.timeout_keep_alive`, `.http_header_timeout`, `.limit_concurrency`
    (connection_cap), `.h11_max_incomplete_event_size` (server.py).

    Raises:
        ValueError: `config.api_key_file` is set but unreadable or empty; a budget of body bytes
            in flight below the chat route's body limit (no chat body could ever be read).
    """
    keys = read_api_keys(config.api_key_file) if config.api_key_file else frozenset()
    services = {"adapters": config.adapters, **({"vision": config.vision} if config.vision else {}),
                "decoder": config.decoder, "pooling": config.pooling}
    backend = Backend(core, services, keys, max_request_bytes=max_grpc_bytes,
                      has_decoders=lambda: core.decoders.replicas.ever_ready,
                      **({"gateway_health": gateway_health} if gateway_health else {}))
    max_body_bytes = max_grpc_bytes * BODY_BYTES_PER_GRPC_BYTE
    in_flight = config.max_body_bytes_in_flight or BODY_BUDGET_PER_BODY_LIMIT * max_body_bytes
    if in_flight < max_body_bytes:
        raise ValueError(f"max_body_bytes_in_flight is {in_flight}; it must be 0 or at least the chat route's body "
                         f"limit, {max_body_bytes} bytes (from --max-images)")
    app = create_app(backend, max_body_bytes, extra_routes, return_tokens_as_token_ids=config.return_tokens_as_token_ids,
                     body_budget=BodyBudget(in_flight))
    host = config.address.rpartition(":")[0]
    return HttpServer(app, host, config.http_port, on_stop=backend.close, tls=tls,
                      timeout_keep_alive=config.timeout_keep_alive, header_timeout_s=config.http_header_timeout,
                      limit_concurrency=connection_cap(config.limit_concurrency),
                      h11_max_incomplete_event_size=config.h11_max_incomplete_event_size)
