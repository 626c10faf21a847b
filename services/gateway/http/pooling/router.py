"""POST /v1/embeddings, /v1/rerank and /rerank (Jina's, Cohere's, or TEI's body), /v1/score and /score."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.gateway.http.backend import Backend
from services.gateway.http.errors import TEI_SHAPED, ApiError, naming
from services.gateway.http.json_body import OffLoopJsonRoute
from services.gateway.http.pooling import protocol, serving
from services.gateway.http.tei import protocol as tei_protocol
from services.gateway.http.tei import serving as tei_serving


def router(backend: Backend) -> APIRouter:
    routes = APIRouter(route_class=OffLoopJsonRoute)  # bodies past 1 MiB parse off the loop

    @routes.post("/v1/embeddings", response_model=protocol.EmbeddingList)
    async def embeddings(body: protocol.EmbeddingRequest):
        request = serving.embed_request(body, await backend.pooling_model(body.model))
        with naming(serving.embed_fields(body)):
            reply = await serving.embed(backend, request)
        data = [protocol.Embedding(index=i, embedding=e) for i, e in enumerate(serving.embeddings(reply))]
        return protocol.EmbeddingList(data=data, model=reply.model, usage=serving.usage(reply))

    @routes.post("/v1/rerank", response_model=protocol.RerankResponse)
    async def rerank(body: protocol.RerankRequest) -> protocol.RerankResponse:
        request = serving.rerank_request(body, await backend.pooling_model(body.model), tei_allowed=False)
        with naming(serving.RERANK_FIELDS):
            return serving.rerank_response(await serving.rerank(backend, request))

    @routes.post("/rerank", response_model=protocol.RerankResponse | list[tei_protocol.TeiRank], summary="Rerank")
    async def rerank_jina_or_tei(body: protocol.RerankRequest, http: Request):
        """Jina's and Cohere's rerank, as /v1/rerank; or TEI's, when the body sends `texts`: then the
        answer (and any refusal) is TEI's shape."""
        tei = body.texts is not None
        if tei:
            http.scope[TEI_SHAPED] = True
        request = serving.rerank_request(body, await backend.pooling_model(body.model), tei_allowed=True)
        with naming(serving.TEI_RERANK_FIELDS if tei else serving.RERANK_FIELDS):
            reply = await serving.rerank(backend, request)
        return JSONResponse(tei_serving.tei_ranks(reply)) if tei else serving.rerank_response(reply)

    async def score(body: protocol.ScoreRequest) -> protocol.ScoreResponse:
        """vLLM's score: a cross-encoder's relevance (sigmoid of its logit), or an embedding model's
        cosine similarity, of each (text_1, text_2) pair."""
        requests = serving.score_requests(body, await backend.pooling_model(body.model))
        if len(requests) > 1:  # pairwise: one call per pair, as many as one call may hold documents
            limit = (await backend.info()).pooling.max_batch_size
            if limit and len(requests) > limit:
                raise ApiError(400, f"text_1 and text_2 hold {len(requests)} pairs; the pooling service's "
                                    f"max_batch_size is {limit}", param="text_1")
        with naming(serving.SCORE_FIELDS):
            return serving.scores(await asyncio.gather(*(serving.rerank(backend, r) for r in requests)))

    routes.post("/v1/score", response_model=protocol.ScoreResponse)(score)
    routes.post("/score", response_model=protocol.ScoreResponse)(score)
    return routes
