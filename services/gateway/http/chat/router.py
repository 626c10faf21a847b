"""POST /v1/chat/completions and /v1/completions (OpenAI's; vLLM's extra sampling fields)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from services.gateway.http.backend import Backend
from services.gateway.http.chat import protocol, serving, tools
from services.gateway.http.json_body import OffLoopJsonRoute


def router(backend: Backend, as_ids: bool) -> APIRouter:
    """The routes over `backend`; `as_ids`: logprob tokens as `token_id:<id>` unless a request says
    otherwise (vLLM's --return-tokens-as-token-ids)."""
    routes = APIRouter(route_class=OffLoopJsonRoute)  # bodies past 1 MiB parse off the loop

    @routes.post("/v1/chat/completions", response_model=protocol.ChatCompletion)
    async def chat_completions(body: protocol.ChatCompletionRequest, http: Request):
        decoder = await backend.decoder_tools() if body.tools else None
        plan = tools.tool_plan(body, decoder)
        # refused before any call or image copy; built in a worker thread (its images are copied there)
        request = await asyncio.to_thread(serving.chat_request, body, backend.check_generate, plan, decoder)
        model = body.model or await backend.base_model()  # absent: the base model, as vLLM
        request.lora = await backend.lora_for(model)
        shape = serving.chat_shape(body, await serving.answer_model(backend, model, request.lora), as_ids, plan)
        return await serving.answer(backend, [request], body, http, shape)

    @routes.post("/v1/completions", response_model=protocol.Completion)
    async def completions(body: protocol.CompletionRequest, http: Request):
        requests = serving.completion_requests(body)
        model = body.model or await backend.base_model()
        lora = await backend.lora_for(model)
        for request in requests:
            request.lora = lora
        shape = serving.completion_shape(body, await serving.answer_model(backend, model, lora), as_ids)
        return await serving.answer(backend, requests, body, http, shape)

    return routes
