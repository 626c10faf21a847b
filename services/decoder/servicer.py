"""The Decoder gRPC service: protobuf in -> engine -> protobuf out."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest

from services.common.metrics import make_registry
from services.decoder.convert import (
    detokenize_from_pb,
    generate_from_pb,
    info_to_pb,
    output_to_pb,
    prompt_count_to_pb,
    tokenization_to_pb,
    tokenize_from_pb,
)
from services.decoder.engine import LLMEngine
from tessera.v1 import decoder_pb2, decoder_pb2_grpc


class DecoderServicer(decoder_pb2_grpc.DecoderServicer):
    """Serves `engine`; its lifecycle (start, stop, health) is the server's (see __main__)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._metrics = make_registry(engine.collector())  # what --metrics-port serves

    async def Generate(self, request, context):
        config = self.engine.config
        request_input = generate_from_pb(request, config.limits, config.max_model_len, config.generation_defaults)
        # Leaving this generator (cancel, deadline, disconnect) closes the engine stream, which aborts it.
        async for output in self.engine.generate(request_input):
            yield output_to_pb(output)

    async def CountPromptTokens(self, request, context):
        config = self.engine.config
        request_input = generate_from_pb(request, config.limits, config.max_model_len, config.generation_defaults)
        return prompt_count_to_pb(await self.engine.count_prompt_tokens(request_input))

    async def GetInfo(self, request, context):
        return info_to_pb(self.engine.info())

    async def GetMetrics(self, request, context):
        # off the loop: the snapshot waits for the engine's lock, which a step holds
        text = await asyncio.to_thread(generate_latest, self._metrics)
        return decoder_pb2.MetricsResponse(text=text.decode())

    async def Tokenize(self, request, context):
        config = self.engine.config
        result = await self.engine.tokenize(tokenize_from_pb(request, config.limits, config.max_model_len))
        return tokenization_to_pb(result)

    async def Detokenize(self, request, context):
        config = self.engine.config
        token_ids = detokenize_from_pb(request, config.limits, config.max_model_len)
        text = await self.engine.detokenize(token_ids, request.skip_special_tokens)
        return decoder_pb2.DetokenizeResponse(model=self.engine.info().model, text=text)
