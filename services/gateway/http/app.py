"""The FastAPI application: OpenAI-compatible routes over the gateway's in-process core.

Routes: POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/rerank (and /rerank),
/v1/score (and /score), /tokenize, /detokenize; text-embeddings-inference's POST /embed (and /), /rerank with `texts`, GET
/info; GET /v1/models, /v1/models/{model}, /health (also /ping and GET /), /version; POST /v1/load_lora_adapter, /v1/unload_lora_adapter (admin:
the `Authorization` header goes to the adapter registry, which checks its admin token, as the
`authorization` metadata of the gRPC API's admin calls does).
With API keys configured, every inference route and /v1/models needs `Authorization: Bearer <key>`.
`extra_routes` mounts more ASGI apps (e.g. `{"/metrics": prometheus_client.make_asgi_app()}`).
Bodies past `max_body_bytes` (chat, which may carry images) or `max_text_body_bytes` (every other
route), or holding more than MAX_JSON_VALUES values, are refused with 413 before they are parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.errors import DeadlineExceeded, TesseraError, Unavailable
from services.common.message_limits import FRAMING_BYTES, TEXT_BYTES
from services.gateway.core import Call
from services.gateway.http import convert, generate, models, responses
from services.gateway.http.backend import Backend, DecoderNames
from services.gateway.http.errors import HANDLERS, TEI_SHAPED, ApiError, from_error, tei_shaped
from services.gateway.http.request_log import RequestLog
from tessera import package_version
from tessera.protocol import UNKNOWN_ADAPTER
from tessera.v1 import adapters_pb2, decoder_pb2

ERROR_RESPONSES = {status: {"model": responses.ErrorResponse}
                   for status in (400, 401, 403, 404, 408, 413, 429, 500, 503, 504)}


# text-only routes: one Generate's text (message_limits.TEXT_BYTES) and its framing, twice over for
# JSON's escapes (a non-ASCII character is up to 6 bytes as \uXXXX, at most 4 in UTF-8)
TEXT_BODY_BYTES = 2 * (TEXT_BYTES + FRAMING_BYTES)
BODY_READ_TIMEOUT_S = 30.0  # the longest wait for the next piece of a body (a stalled client holds a connection)
BODY_TOTAL_TIMEOUT_S = 300.0  # and for the whole body (a client dripping a byte a piece holds one too)
DISCONNECT_POLL_S = 0.5  # how often a whole (non-streamed) answer checks that its client is still there


def create_app(backend: Backend, max_body_bytes: int, extra_routes: Mapping[str, object] = (),
               max_text_body_bytes: int = TEXT_BODY_BYTES, body_read_timeout_s: float = BODY_READ_TIMEOUT_S,
               body_total_timeout_s: float = BODY_TOTAL_TIMEOUT_S, return_tokens_as_token_ids: bool = False) -> FastAPI:
    """The app over `backend`; `return_tokens_as_token_ids`: logprob tokens as `token_id:<id>` unless a
    request says otherwise (vLLM's --return-tokens-as-token-ids)."""
    app = FastAPI(title="tessera", summary="OpenAI-compatible HTTP API of the tessera gateway",
                  responses=ERROR_RESPONSES)
    for error, handler in HANDLERS.items():
        app.add_exception_handler(error, handler)

    async def api_key(authorization: str | None = Header(default=None)) -> None:
        backend.check_api_key(authorization)

    app.include_router(_generation_routes(backend, return_tokens_as_token_ids), dependencies=[Depends(api_key)])
    app.include_router(_pooling_routes(backend), dependencies=[Depends(api_key)])
    app.include_router(_tei_routes(backend), dependencies=[Depends(api_key)])
    app.include_router(_cluster_routes(backend, [Depends(api_key)]))
    for path, asgi in dict(extra_routes).items():
        app.add_route(path, _AsgiEndpoint(asgi), include_in_schema=False)  # exactly `path`: no 307 to `path/`
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, max_text_bytes=max_text_body_bytes,
                       read_timeout_s=body_read_timeout_s, total_timeout_s=body_total_timeout_s)
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


def _generation_routes(backend: Backend, as_ids: bool) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", response_model=responses.ChatCompletion)
    async def chat_completions(body: models.ChatCompletionRequest, http: Request):
        request = convert.chat_request(body)  # bad input refused before any call
        model = body.model or await backend.base_model()  # absent: the base model, as vLLM
        request.lora = await backend.lora_for(model)
        shape = convert.chat_shape(body, await _answer_model(backend, model, request.lora), as_ids)
        return await _generate(backend, [request], body, http, shape)

    @router.post("/v1/completions", response_model=responses.Completion)
    async def completions(body: models.CompletionRequest, http: Request):
        requests = convert.completion_requests(body)
        model = body.model or await backend.base_model()
        lora = await backend.lora_for(model)
        for request in requests:
            request.lora = lora
        shape = convert.completion_shape(body, await _answer_model(backend, model, lora), as_ids)
        return await _generate(backend, requests, body, http, shape)

    return router


async def _answer_model(backend: Backend, model: str, lora: str) -> str:
    """The `model` an answer names: the adapter, or the base model's first served name (for any alias)."""
    return lora or await backend.base_model()


def _pooling_routes(backend: Backend) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings", response_model=responses.EmbeddingList)
    async def embeddings(body: models.EmbeddingRequest):
        request = convert.embed_request(body, await backend.pooling_model(body.model))
        with _naming(convert.embed_fields(body)):
            reply = await _embed(backend, request)
        data = [responses.Embedding(index=i, embedding=e) for i, e in enumerate(convert.embeddings(reply))]
        return responses.EmbeddingList(data=data, model=reply.model, usage=convert.usage(reply))

    @router.post("/v1/rerank", response_model=responses.RerankResponse)
    async def rerank(body: models.RerankRequest) -> responses.RerankResponse:
        request = convert.rerank_request(body, await backend.pooling_model(body.model), tei_allowed=False)
        with _naming(convert.RERANK_FIELDS):
            return convert.rerank_response(await _rerank(backend, request))

    @router.post("/rerank", response_model=responses.RerankResponse | list[responses.TeiRank], summary="Rerank")
    async def rerank_jina_or_tei(body: models.RerankRequest, http: Request):
        """Jina's and Cohere's rerank, as /v1/rerank; or TEI's, when the body sends `texts`: then the
        answer (and any refusal) is TEI's shape."""
        tei = body.texts is not None
        if tei:
            http.scope[TEI_SHAPED] = True
        request = convert.rerank_request(body, await backend.pooling_model(body.model), tei_allowed=True)
        with _naming(convert.TEI_RERANK_FIELDS if tei else convert.RERANK_FIELDS):
            reply = await _rerank(backend, request)
        return JSONResponse(convert.tei_ranks(reply)) if tei else convert.rerank_response(reply)

    async def score(body: models.ScoreRequest) -> responses.ScoreResponse:
        """vLLM's score: a cross-encoder's relevance (sigmoid of its logit), or an embedding model's
        cosine similarity, of each (text_1, text_2) pair."""
        requests = convert.score_requests(body, await backend.pooling_model(body.model))
        if len(requests) > 1:  # pairwise: one call per pair, as many as one call may hold documents
            limit = (await backend.info()).pooling.max_batch_size
            if limit and len(requests) > limit:
                raise ApiError(400, f"text_1 and text_2 hold {len(requests)} pairs; the pooling service's "
                                    f"max_batch_size is {limit}", param="text_1")
        with _naming(convert.SCORE_FIELDS):
            return convert.scores(await asyncio.gather(*(_rerank(backend, r) for r in requests)))

    router.post("/v1/score", response_model=responses.ScoreResponse)(score)
    router.post("/score", response_model=responses.ScoreResponse)(score)

    @router.post("/tokenize", response_model=responses.TokenizeResponse)
    async def tokenize(body: models.TokenizeRequest):
        request = convert.tokenize_request(body, await backend.tokenizer_model(body.model))
        backend.check_size(request)
        with _naming(convert.TOKENIZE_FIELDS):
            reply = await backend.core.tokenize(request, Call())
        tokens = list(reply.results[0].tokens) if reply.results else []
        return responses.TokenizeResponse(model=reply.model, count=len(tokens),
                                          max_model_len=reply.max_model_len or None,
                                          tokens=[t.id for t in tokens], token_strs=[t.text for t in tokens])

    @router.post("/detokenize", response_model=responses.DetokenizeResponse)
    async def detokenize(body: models.DetokenizeRequest):
        request = decoder_pb2.DetokenizeRequest(model=await backend.tokenizer_model(body.model), token_ids=body.tokens)
        backend.check_size(request)
        with _naming(convert.DETOKENIZE_FIELDS):
            reply = await backend.core.detokenize(request, Call())
        return responses.DetokenizeResponse(model=reply.model, prompt=reply.text)

    return router


def _tei_routes(backend: Backend) -> APIRouter:
    """text-embeddings-inference's native routes, so TEI's clients work unchanged: POST /embed and
    POST / (TEI's root route for an embedding model, where huggingface_hub's InferenceClient sends
    feature_extraction), GET /info; TEI's /rerank body is taken on POST /rerank (_pooling_routes).
    Refusals answer TEI's error shape (errors.TEI_PATHS)."""
    router = APIRouter(responses={status: {"model": responses.TeiErrorResponse} for status in ERROR_RESPONSES})

    async def embed(body: models.TeiEmbedRequest):
        """TEI's embed: one vector per input, in input order (normalized unless `normalize` is false)."""
        request = convert.embed_request(body, await backend.pooling_model(body.model))
        with _naming(convert.embed_fields(body)):
            return JSONResponse(convert.embeddings(await _embed(backend, request)))

    router.post("/embed", response_model=list[list[float]])(embed)
    router.post("/", response_model=list[list[float]], summary="TEI's root route: /embed")(embed)

    @router.get("/info", response_model=responses.TeiInfo)
    async def info():
        """TEI's model info, for the pooling service's default model."""
        cluster = await backend.info()
        if not cluster.pooling.model:
            raise ApiError(503, "the pooling service has not answered: " + "; ".join(cluster.unavailable),
                           "service_unavailable")
        return convert.tei_info(cluster.pooling, package_version())

    return router


def _cluster_routes(backend: Backend, inference) -> APIRouter:
    """Models (an inference route: API key), adapters (admin: the registry's token), health (open)."""
    router = APIRouter()

    def admin(request: Request) -> Call:
        """The registry checks the caller's own credentials (none sent: UNAUTHENTICATED, 401)."""
        return Call(authorization=request.headers.get("authorization"))

    @router.get("/v1/models", dependencies=inference, response_model=responses.ModelList)
    async def list_models():
        return JSONResponse(_listed(await _models(backend)))

    @router.get("/v1/models/{model}", dependencies=inference, response_model=responses.Model)
    async def retrieve_model(model: str):
        """One entry of /v1/models (OpenAI's models.retrieve); 404 for a name not served."""
        listed = await _models(backend)
        for entry in listed.data:
            if entry.id == model:
                return JSONResponse(_entry(entry))
        if listed.unavailable:  # it may be an adapter the registry would have listed
            raise ApiError(503, f"model {model!r} is not a served base or pooling model, and adapters cannot be "
                                f"listed: {'; '.join(listed.unavailable)}", "service_unavailable")
        raise ApiError(404, f"model {model!r} is not served here (GET /v1/models lists what is)", "not_found_error",
                       param="model")

    @router.post("/v1/load_lora_adapter", response_model=responses.Model)
    async def load_lora_adapter(body: models.LoadLoraAdapterRequest, request: Request):
        cluster = await backend.info()
        served = {cluster.decoder.model, *cluster.decoder.served_model_names, cluster.pooling.model,
                  *(name for m in cluster.pooling.models for name in (m.model, *m.aliases))} - {""}
        if body.lora_name in served:
            raise ApiError(400, f"lora_name {body.lora_name!r} is the name of a served model; an adapter needs a "
                                "name of its own", param="lora_name")
        load = adapters_pb2.LoadAdapterRequest(name=body.lora_name, path=body.lora_path, replace=body.replace,
                                               drain=body.drain)
        backend.check_size(load)
        info = await backend.core.load_adapter(load, admin(request))
        # the entry /v1/models lists for it from now on (its context is the base model's)
        return JSONResponse(_entry(responses.Model(id=info.name, root=info.path, parent=await backend.base_model(),
                                                   max_model_len=cluster.decoder.max_model_len or None)))

    @router.post("/v1/unload_lora_adapter", response_model=responses.Model)
    async def unload_lora_adapter(body: models.UnloadLoraAdapterRequest, request: Request):
        unload = adapters_pb2.UnloadAdapterRequest(name=body.lora_name, drain=body.drain)
        backend.check_size(unload)
        reply = await backend.core.unload_adapter(unload, admin(request))
        return JSONResponse(_entry(responses.Model(id=reply.name)))

    async def health():
        """200 while every required service serves, else 503 naming those that do not."""
        problems, degraded = await backend.not_serving()
        if problems:
            return JSONResponse(responses.Health(status="unavailable", not_serving=problems,
                                                 degraded=degraded).model_dump(), status_code=503)
        return responses.Health(status="ok", degraded=degraded)

    health_answers = {503: {"model": responses.Health}}
    router.get("/health", response_model=responses.Health, responses=health_answers)(health)
    # the same check where vLLM (SageMaker's /ping) and TEI (GET /, /ping) serve theirs
    router.get("/ping", response_model=responses.Health, responses=health_answers, summary="Health (/ping)")(health)
    router.post("/ping", response_model=responses.Health, responses=health_answers,
                summary="Health (POST /ping)")(health)
    router.get("/", response_model=responses.Health, responses=health_answers, summary="Health (TEI's GET /)")(health)

    @router.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's /version: the installed tessera's version."""
        return {"version": package_version()}

    return router


IMAGE_ROUTES = frozenset({"/v1/chat/completions"})  # bodies that may carry base64 images
# JSON values in one body, counted as its commas (every array element or object member after the
# first follows one): 64 prompts of 16384 token ids. A body is parsed whole into Python objects,
# ~40-130 bytes each, before any field is validated: without this bound a 50 MB list of small ints
# took 6.6 GB of the gateway's memory (4 M ids, 8 MiB, still took 1.2 GB and 4 s of its loop).
# Commas inside strings count too, which only makes it stricter.
MAX_JSON_VALUES = 64 * 16384


class BodyLimit:
    """Refuses with 413 a body past its route's byte limit (`max_bytes` where images may come, else
    `max_text_bytes`) or holding more than MAX_JSON_VALUES values: from its Content-Length before
    reading it, else as soon as the bytes read pass a limit; with 408 a body whose next piece has
    not come for `read_timeout_s`, or that is not in after `total_timeout_s` (a client that announces
    a body and stalls, or drips it)."""

    def __init__(self, app, max_bytes: int, max_text_bytes: int, read_timeout_s: float = BODY_READ_TIMEOUT_S,
                 total_timeout_s: float = BODY_TOTAL_TIMEOUT_S):
        self.app, self.max_bytes, self.max_text_bytes = app, max_bytes, min(max_bytes, max_text_bytes)
        self.read_timeout_s, self.total_timeout_s = read_timeout_s, total_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes if scope.get("path") in IMAGE_ROUTES else self.max_text_bytes
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            refusal = ApiError(413, f"the request body has {int(length)} bytes; the limit is {limit} for "
                                    f"{scope.get('path')}")
            return await refusal.response(tei_shaped(scope))(scope, receive, send)
        seen = values = 0
        reading = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout_s

        async def counted():
            nonlocal seen, values, reading
            if not reading:  # the body is in: from here on only a disconnect comes, whenever it does
                return await receive()
            try:
                async with asyncio.timeout_at(min(loop.time() + self.read_timeout_s, deadline)):
                    message = await receive()
            except TimeoutError:
                why = (f"it took longer than {self.total_timeout_s:g} s" if loop.time() >= deadline
                       else f"no bytes for {self.read_timeout_s:g} s")
                raise ApiError(408, f"the request body stalled: {why} after {seen} bytes") from None
            reading = message.get("type") == "http.request" and message.get("more_body", False)
            chunk = message.get("body", b"")
            seen += len(chunk)
            values += chunk.count(b",")
            if seen > limit:
                raise ApiError(413, f"the request body passed {limit} bytes, the limit for {scope.get('path')}")
            if values > MAX_JSON_VALUES:
                raise ApiError(413, f"the request body holds more than {MAX_JSON_VALUES} JSON values (counted as "
                                    f"commas); the limit is {MAX_JSON_VALUES}")
            return message

        await self.app(scope, counted, send)


async def _generate(backend: Backend, requests, body: models.SamplingFields, http: Request, shape: generate.Shape):
    """Open every prompt's Generate (so a refusal answers with its status), then answer whole or as SSE.

    A whole answer whose client goes away is cancelled (its KV blocks and leases come back), as a
    stream is when its response ends early."""
    try:
        streams = await _open(backend, requests, http)
    except TesseraError as error:
        fields = convert.chat_fields(body) if shape.chat else convert.completion_fields(body)
        raise _as_model_error(error, body.model, requests[0].lora, fields) from error
    if body.stream:
        return StreamingResponse(generate.events(streams, body.n, shape), media_type="text/event-stream")
    collecting = asyncio.ensure_future(generate.collect(streams, body.n, shape))
    while not collecting.done():
        await asyncio.wait([collecting], timeout=DISCONNECT_POLL_S)
        if not collecting.done() and await http.is_disconnected():
            collecting.cancel()  # collect's finally cancels every prompt's call
            raise ApiError(499, "the client closed the connection", "cancelled")
    tally = collecting.result()
    return (generate.chat_completion if shape.chat else generate.completion)(tally)


def _as_model_error(error: TesseraError, model: str, lora: str, fields: dict[str, str]) -> ApiError:
    """A refusal of Generate in the HTTP API's terms: the body's field it names (`fields`: `lora` is
    the body's `model`), and an unknown adapter (its reason) as an unknown `model`."""
    refusal = from_error(error, fields)
    details = refusal.message
    if lora and error.reason == UNKNOWN_ADAPTER:
        return ApiError(404, f"model {model!r} is neither the decoder's model nor a loaded adapter ({details})",
                        "not_found_error", param="model")
    return refusal  # a refusal of `lora` names `model` by `fields`


async def _open(backend: Backend, requests, http: Request) -> list[generate.Stream]:
    """Every prompt's Generate started at once, each waited for until its first message.

    All prompts are queued together (one after another, prompt k would not reach the decoder
    before prompt k - 1 had its first token), and a client that leaves while they wait cancels
    every one, as it does once they stream.

    Raises:
        TesseraError: the first prompt (in order) that was refused; the others are cancelled.
        ApiError: 499 when the client closed the connection first.
    """
    for request in requests:
        backend.check_size(request)
    opening = [asyncio.ensure_future(generate.Stream.open(backend.core, request)) for request in requests]
    try:
        while True:
            _, pending = await asyncio.wait(opening, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_EXCEPTION)
            for task in opening:
                if task.done() and task.exception() is not None:
                    raise task.exception()
            if not pending:
                return [task.result() for task in opening]
            if await http.is_disconnected():
                raise ApiError(499, "the client closed the connection", "cancelled")
    except BaseException:
        for task in opening:
            task.cancel()  # a call still waiting for its first message cancels itself (Stream.open)
        await generate.close([task.result() for task in opening
                              if task.done() and not task.cancelled() and task.exception() is None])
        raise


@contextlib.contextmanager
def _naming(fields: dict[str, str]):
    """A refusal of the core's that names a protobuf field names the body's (`fields`: the route's
    table in convert.py) in `param` and its message."""
    try:
        yield
    except TesseraError as error:
        raise from_error(error, fields) from error


async def _embed(backend: Backend, request):
    backend.check_size(request)
    return await backend.core.embed(request, Call())


async def _rerank(backend: Backend, request):
    backend.check_size(request)
    return await backend.core.rerank(request, Call())


async def _models(backend: Backend) -> responses.ModelList:
    """The decoder's base model (its first served name), every pooling model, and each loaded
    adapter (parent: the base); aliases are accepted in requests, not listed."""
    info = await backend.info()
    if info.unavailable and not info.decoder.model and not info.pooling.model:
        raise ApiError(503, "; ".join(info.unavailable), "service_unavailable")
    data = []
    base = DecoderNames.of(info.decoder).base if info.decoder.model else None
    if base:
        data.append(responses.Model(id=base, root=base, max_model_len=info.decoder.max_model_len,
                                    generation_config=info.decoder.generation_config or None,
                                    generation_defaults=dict(info.decoder.generation_defaults) or None))
    pooled = list(info.pooling.models) or ([info.pooling] if info.pooling.model else [])
    for model in pooled:
        data.append(responses.Model(id=model.model, root=model.model, max_model_len=model.max_input_length or None))
    try:
        adapters = (await backend.core.list_adapters(adapters_pb2.ListAdaptersRequest(), Call())).adapters
    except (Unavailable, DeadlineExceeded) as error:
        # the registry is down: the models still served are listed (as vLLM's list never fails),
        # and the answer says which part is missing
        return responses.ModelList(data=data, unavailable=[str(error) or f"adapters: {error.code.name}"])
    for adapter in adapters:
        if adapter.state in ("ready", "draining"):  # not those registered for another base model (base_*)
            data.append(responses.Model(id=adapter.name, root=adapter.path, parent=base,
                                        max_model_len=info.decoder.max_model_len or None))
    return responses.ModelList(data=data)


# tessera's fields of a /v1/models entry, present only when they say something
_ENTRY_EXTRAS = ("generation_config", "generation_defaults")


def _entry(model: responses.Model) -> dict:
    entry = model.model_dump()
    for name in _ENTRY_EXTRAS:
        if entry[name] is None:
            del entry[name]
    return entry


def _listed(listed: responses.ModelList) -> dict:
    """/v1/models' answer: `unavailable` only when the registry did not answer."""
    answer = {"object": listed.object, "data": [_entry(m) for m in listed.data]}
    if listed.unavailable is not None:
        answer["unavailable"] = listed.unavailable
    return answer


class _AsgiEndpoint:
    """An ASGI app as a route endpoint (Starlette wraps plain functions as request handlers)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)
