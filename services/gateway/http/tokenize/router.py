"""POST /tokenize and /detokenize (vLLM's), with the decoder's tokenizer unless `model` names a pooling model."""

from __future__ import annotations

from fastapi import APIRouter

from services.gateway.core import Call
from services.gateway.http.backend import Backend
from services.gateway.http.errors import naming
from services.gateway.http.json_body import OffLoopJsonRoute
from services.gateway.http.tokenize import protocol, serving
from tessera.v1 import decoder_pb2


def router(backend: Backend) -> APIRouter:
    routes = APIRouter(route_class=OffLoopJsonRoute)  # bodies past 1 MiB parse off the loop

    @routes.post("/tokenize", response_model=protocol.TokenizeResponse)
    async def tokenize(body: protocol.TokenizeRequest):
        request = serving.tokenize_request(body, await backend.tokenizer_model(body.model))
        backend.check_size(request)
        with naming(serving.TOKENIZE_FIELDS):
            reply = await backend.core.tokenize(request, Call())
        tokens = list(reply.results[0].tokens) if reply.results else []
        return protocol.TokenizeResponse(model=reply.model, count=len(tokens),
                                         max_model_len=reply.max_model_len or None,
                                         tokens=[t.id for t in tokens], token_strs=[t.text for t in tokens])

    @routes.post("/detokenize", response_model=protocol.DetokenizeResponse)
    async def detokenize(body: protocol.DetokenizeRequest):
        request = decoder_pb2.DetokenizeRequest(model=await backend.tokenizer_model(body.model), token_ids=body.tokens)
        backend.check_size(request)
        with naming(serving.DETOKENIZE_FIELDS):
            reply = await backend.core.detokenize(request, Call())
        return protocol.DetokenizeResponse(model=reply.model, prompt=reply.text)

    return routes
