"""The Decoder gRPC service: protobuf in -> engine -> protobuf out."""

from __future__ import annotations

from services.decoder.convert import generate_from_pb, info_to_pb, output_to_pb
from services.decoder.engine import LLMEngine
from tessera.v1 import decoder_pb2_grpc


class DecoderServicer(decoder_pb2_grpc.DecoderServicer):
    """Serves `engine`; its lifecycle (start, stop, health) is the server's (see __main__)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    async def Generate(self, request, context):
        config = self.engine.config
        # Leaving this generator (cancel, deadline, disconnect) closes the engine stream, which aborts it.
        async for output in self.engine.generate(generate_from_pb(request, config.limits, config.max_model_len)):
            yield output_to_pb(output)

    async def GetInfo(self, request, context):
        return info_to_pb(self.engine.info())
