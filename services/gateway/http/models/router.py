"""GET /v1/models and /v1/models/{model} (an inference route: API key), POST /v1/load_lora_adapter
and /v1/unload_lora_adapter (admin: the `Authorization` header goes to the adapter registry, which
checks its admin token, as the `authorization` metadata of the gRPC API's admin calls does),
/health (also /ping and GET /), /health/generate, /health/embed, /health/live and /version (open;
services/gateway/readiness.py says what each health route follows)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.gateway.core import Call
from services.gateway.http.backend import Backend
from services.gateway.http.errors import ApiError
from services.gateway.http.json_body import OffLoopJsonRoute
from services.gateway.http.models import protocol, serving
from services.gateway.readiness import CAPABILITIES, EMBED, GENERATE
from tessera import package_version
from tessera.v1 import adapters_pb2


def router(backend: Backend, inference) -> APIRouter:
    """The routes over `backend`; `inference`: the dependencies of an inference route (the API key)."""
    routes = APIRouter(route_class=OffLoopJsonRoute)  # bodies past 1 MiB parse off the loop

    def admin(request: Request) -> Call:
        """The registry checks the caller's own credentials (none sent: UNAUTHENTICATED, 401)."""
        return Call(authorization=request.headers.get("authorization"))

    @routes.get("/v1/models", dependencies=inference, response_model=protocol.ModelList)
    async def list_models():
        return JSONResponse(serving.model_list(await serving.served_models(backend)))

    @routes.get("/v1/models/{model}", dependencies=inference, response_model=protocol.Model)
    async def retrieve_model(model: str):
        """One entry of /v1/models (OpenAI's models.retrieve); 404 for a name not served."""
        listed = await serving.served_models(backend)
        for entry in listed.data:
            if entry.id == model:
                return JSONResponse(serving.model_entry(entry))
        if listed.unavailable:  # it may be an adapter the registry would have listed
            raise ApiError(503, f"model {model!r} is not a served base or pooling model, and adapters cannot be "
                                f"listed: {'; '.join(listed.unavailable)}", "service_unavailable")
        raise ApiError(404, f"model {model!r} is not served here (GET /v1/models lists what is)", "not_found_error",
                       param="model")

    @routes.post("/v1/load_lora_adapter", response_model=protocol.Model)
    async def load_lora_adapter(body: protocol.LoadLoraAdapterRequest, request: Request):
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
        return JSONResponse(serving.model_entry(protocol.Model(
            id=info.name, root=info.path, parent=await backend.base_model(),
            max_model_len=cluster.decoder.max_model_len or None)))

    @routes.post("/v1/unload_lora_adapter", response_model=protocol.Model)
    async def unload_lora_adapter(body: protocol.UnloadLoraAdapterRequest, request: Request):
        unload = adapters_pb2.UnloadAdapterRequest(name=body.lora_name, drain=body.drain)
        backend.check_size(unload)
        reply = await backend.core.unload_adapter(unload, admin(request))
        return JSONResponse(serving.model_entry(protocol.Model(id=reply.name)))

    _health_routes(routes, backend)

    @routes.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's /version: the installed tessera's version."""
        return {"version": package_version()}

    return routes


def _health_routes(routes: APIRouter, backend: Backend) -> None:
    """/health (also /ping and GET /), /health/generate, /health/embed, /health/live on `routes`."""

    def answer(report, capability: str | None):
        body = protocol.Health(status=report.status(capability), not_serving=report.not_serving,
                               degraded=report.degraded,
                               serving={c: report.readiness.ready(c) for c in CAPABILITIES})
        return JSONResponse(body.model_dump(), status_code=200 if body.status != "unavailable" else 503)

    async def health():
        """Readiness for the core traffic: 200 while the gateway can serve it (a decoder replica
        serves; in a deployment without decoders, a pooler), naming every dependency down; else 503."""
        return answer(await backend.health(), None)

    health_answers = {503: {"model": protocol.Health}}
    routes.get("/health", response_model=protocol.Health, responses=health_answers)(health)
    # the same check where vLLM (SageMaker's /ping) and TEI (GET /, /ping) serve theirs
    routes.get("/ping", response_model=protocol.Health, responses=health_answers, summary="Health (/ping)")(health)
    routes.post("/ping", response_model=protocol.Health, responses=health_answers,
                summary="Health (POST /ping)")(health)
    routes.get("/", response_model=protocol.Health, responses=health_answers, summary="Health (TEI's GET /)")(health)

    @routes.get("/health/generate", response_model=protocol.Health, responses=health_answers)
    async def health_generate():
        """Readiness for chat and completions: 200 while a decoder replica serves, else 503."""
        return answer(await backend.health(), GENERATE)

    @routes.get("/health/embed", response_model=protocol.Health, responses=health_answers)
    async def health_embed():
        """Readiness for embeddings, rerank and score: 200 while a pooler replica serves, else 503."""
        return answer(await backend.health(), EMBED)

    @routes.get("/health/live", responses={503: {"description": "the gateway is starting or draining"}})
    async def health_live():
        """Liveness: 200 while the gateway itself serves (its gRPC health), whatever its dependencies do."""
        reason = await backend.gateway_health()
        if reason is not None:
            return JSONResponse({"status": "unavailable", "not_serving": [f"gateway: gateway {reason}"]},
                                status_code=503)
        return {"status": "ok"}
