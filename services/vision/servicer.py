"""`tessera.v1.Vision` servicer: protobuf in -> `VisionEngine` call -> protobuf out, nothing more."""

from __future__ import annotations

from services.vision.convert import (
    encoded_image_to_pb,
    image_source_from_pb,
    prompt_budget_from_pb,
    vision_info_to_pb,
)
from services.vision.engine import VisionEngine
from tessera.v1 import vision_pb2, vision_pb2_grpc


class VisionServicer(vision_pb2_grpc.VisionServicer):
    def __init__(self, engine: VisionEngine) -> None:
        self.engine = engine

    async def EncodeImages(self, request: vision_pb2.EncodeImagesRequest, context) -> vision_pb2.EncodeImagesResponse:
        self.engine.check_count(len(request.images))  # before touching any image
        sources = [image_source_from_pb(image) for image in request.images]
        encoded = await self.engine.encode(sources, request.max_image_tokens, prompt_budget_from_pb(request))
        return vision_pb2.EncodeImagesResponse(images=[encoded_image_to_pb(image) for image in encoded])

    async def GetInfo(self, request: vision_pb2.VisionInfoRequest, context) -> vision_pb2.VisionInfo:
        return vision_info_to_pb(self.engine.info())
