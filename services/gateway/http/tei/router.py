"""text-embeddings-inference's native routes, so TEI's clients work unchanged: POST /embed and
POST / (TEI's root route for an embedding model, where huggingface_hub's InferenceClient sends
feature_extraction), GET /info; TEI's /rerank body is taken on POST /rerank (pooling/router.py).
Refusals answer TEI's error shape (errors.TEI_PATHS)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from services.gateway.http.backend import Backend
from services.gateway.http.errors import ApiError, naming
from services.gateway.http.json_body import OffLoopJsonRoute
from services.gateway.http.pooling import serving as pooling
from services.gateway.http.protocol import ERROR_RESPONSES
from services.gateway.http.tei import protocol, serving
from tessera import package_version


def router(backend: Backend) -> APIRouter:
    routes = APIRouter(route_class=OffLoopJsonRoute,  # bodies past 1 MiB parse off the loop
                       responses={status: {"model": protocol.TeiErrorResponse} for status in ERROR_RESPONSES})

    async def embed(body: protocol.TeiEmbedRequest):
        """TEI's embed: one vector per input, in input order (normalized unless `normalize` is false)."""
        request = pooling.embed_request(body, await backend.pooling_model(body.model))
        with naming(pooling.embed_fields(body)):
            return JSONResponse(pooling.embeddings(await pooling.embed(backend, request)))

    routes.post("/embed", response_model=list[list[float]])(embed)
    routes.post("/", response_model=list[list[float]], summary="TEI's root route: /embed")(embed)

    @routes.get("/info", response_model=protocol.TeiInfo)
    async def info():
        """TEI's model info, for the pooling service's default model."""
        cluster = await backend.info()
        if not cluster.pooling.model:
            raise ApiError(503, "the pooling service has not answered: " + "; ".join(cluster.unavailable),
                           "service_unavailable")
        return serving.tei_info(cluster.pooling, package_version())

    return routes
