"""The FastAPI application: OpenAI-compatible routes over the gateway's in-process core.

One package per route family, each `router.py` (the routes), `protocol.py` (bodies and answers) and
`serving.py` (bodies <-> the core's messages), as vLLM's entrypoints:
- chat/: POST /v1/chat/completions, /v1/completions;
- pooling/: POST /v1/embeddings, /v1/rerank (and /rerank), /v1/score (and /score);
- tokenize/: POST /tokenize, /detokenize;
- tei/: text-embeddings-inference's POST /embed (and /), GET /info (TEI's /rerank body: pooling/);
- models/: GET /v1/models, /v1/models/{model}, /health (also /ping and GET /), /health/generate,
  /health/embed, /health/live, /version; POST
  /v1/load_lora_adapter, /v1/unload_lora_adapter (admin: the `Authorization` header goes to the
  adapter registry, which checks its admin token, as the gRPC API's admin metadata does).
With API keys configured, every inference route and /v1/models needs `Authorization: Bearer <key>`.
`extra_routes` mounts more ASGI apps (e.g. `{"/metrics": prometheus_client.make_asgi_app()}`).
Bodies past `max_body_bytes` (chat, which may carry images) or `max_text_body_bytes` (every other
route), or holding more than body_limit.MAX_JSON_VALUES values, are refused with 413 before they
are parsed; past `body_budget` (bytes of bodies in flight) with 503 and Retry-After. JSON bodies
past 1 MiB are parsed in a worker thread (json_body.py), off the loop that serves gRPC too.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import Depends, FastAPI, Header

from services.gateway.http.backend import Backend
from services.gateway.http.body_limit import (
    BODY_READ_TIMEOUT_S,
    BODY_TOTAL_TIMEOUT_S,
    TEXT_BODY_BYTES,
    BodyBudget,
    BodyLimit,
)
from services.gateway.http.chat import router as chat
from services.gateway.http.chat.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.http.errors import HANDLERS
from services.gateway.http.fields import Body
from services.gateway.http.models import router as models
from services.gateway.http.models.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from services.gateway.http.pooling import router as pooling
from services.gateway.http.pooling.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from services.gateway.http.protocol import ERROR_RESPONSES
from services.gateway.http.request_log import RequestLog
from services.gateway.http.tei import router as tei
from services.gateway.http.tei.protocol import TeiEmbedRequest
from services.gateway.http.tokenize import router as tokenize
from services.gateway.http.tokenize.protocol import DetokenizeRequest, TokenizeRequest


def create_app(backend: Backend, max_body_bytes: int, extra_routes: Mapping[str, object] = (),
               max_text_body_bytes: int = TEXT_BODY_BYTES, body_read_timeout_s: float = BODY_READ_TIMEOUT_S,
               body_total_timeout_s: float = BODY_TOTAL_TIMEOUT_S, return_tokens_as_token_ids: bool = False,
               body_budget: BodyBudget | None = None) -> FastAPI:
    """The app over `backend`; `return_tokens_as_token_ids`: logprob tokens as `token_id:<id>` unless a
    request says otherwise (vLLM's --return-tokens-as-token-ids); `body_budget`: the bytes of bodies
    in flight over all requests (None: no budget)."""
    app = FastAPI(title="tessera", summary="OpenAI-compatible HTTP API of the tessera gateway",
                  responses=ERROR_RESPONSES)
    for error, handler in HANDLERS.items():
        app.add_exception_handler(error, handler)

    async def api_key(authorization: str | None = Header(default=None)) -> None:
        backend.check_api_key(authorization)

    inference = [Depends(api_key)]
    app.include_router(chat.router(backend, return_tokens_as_token_ids), dependencies=inference)
    app.include_router(pooling.router(backend), dependencies=inference)
    app.include_router(tokenize.router(backend), dependencies=inference)
    app.include_router(tei.router(backend), dependencies=inference)
    app.include_router(models.router(backend, inference))
    for path, asgi in dict(extra_routes).items():
        app.add_route(path, _AsgiEndpoint(asgi), include_in_schema=False)  # exactly `path`: no 307 to `path/`
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, max_text_bytes=max_text_body_bytes,
                       read_timeout_s=body_read_timeout_s, total_timeout_s=body_total_timeout_s, budget=body_budget)
    app.add_middleware(RequestLog)  # outermost: logs the 413s too
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document without its 422 answers: a body that does not validate is 400 here
    (errors.validation_error_handler), already listed with the other error statuses."""
    if app.openapi_schema is None:
        document = FastAPI.openapi(app)  # builds and caches app.openapi_schema; edited in place once
        for item in document.get("paths", {}).values():
            for operation in item.values():
                operation.get("responses", {}).pop("422", None)
        schemas = document.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
    return app.openapi_schema


class _AsgiEndpoint:
    """An ASGI app as a route endpoint (Starlette wraps plain functions as request handlers)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


# Every request body, by the routes that take it (docs/render_http.py lists their fields).
REQUEST_BODIES: dict[str, type[Body]] = {
    "POST /v1/chat/completions": ChatCompletionRequest,
    "POST /v1/completions": CompletionRequest,
    "POST /v1/embeddings": EmbeddingRequest,
    "POST /v1/rerank, /rerank": RerankRequest,
    "POST /v1/score, /score": ScoreRequest,
    "POST /tokenize": TokenizeRequest,
    "POST /detokenize": DetokenizeRequest,
    "POST /embed, / (TEI)": TeiEmbedRequest,
    "POST /v1/load_lora_adapter": LoadLoraAdapterRequest,
    "POST /v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}
