"""`tessera.v1.Vision` servicer: protobuf in -> engine -> protobuf out.

The engine (encoder weights) is built in `start`, which `serve` awaits before health says
SERVING. Decoding runs in worker threads (concurrently); the encoder loads and runs on the
process's compute thread (services/common/compute.py), one batch at a time, so the event loop
keeps answering health checks while a batch encodes.
"""

from __future__ import annotations

import asyncio

from services.common.compute import shared_compute_thread
from services.common.errors import InvalidArgument, Unavailable
from services.vision.config import VisionConfig
from services.vision.engine import VisionEngine
from services.vision.wire import encoded_image_to_pb, image_source_from_pb, vision_info_to_pb
from tessera.v1 import vision_pb2, vision_pb2_grpc


class VisionServicer(vision_pb2_grpc.VisionServicer):
    def __init__(self, config: VisionConfig) -> None:
        self.config = config
        self._engine: VisionEngine | None = None
        self._compute = shared_compute_thread()

    async def start(self) -> None:
        self._engine = await self._compute.run(VisionEngine, self.config)

    @property
    def engine(self) -> VisionEngine:
        if self._engine is None:
            raise Unavailable("the vision encoder is still loading")
        return self._engine

    async def EncodeImages(self, request: vision_pb2.EncodeImagesRequest, context) -> vision_pb2.EncodeImagesResponse:
        engine = self.engine
        engine.processor.check_count(len(request.images))  # before touching any image
        sources = [image_source_from_pb(image) for image in request.images]
        if request.max_image_tokens < 0:
            raise InvalidArgument(f"max_image_tokens must be >= 0 (0 = no budget), got {request.max_image_tokens}")
        # headers and budgets before any decoding; encoder-cache hits skip decoding
        prepared = await asyncio.to_thread(engine.process, sources, request.max_image_tokens)
        encoded = await self._compute.run(engine.encode, prepared)
        return vision_pb2.EncodeImagesResponse(images=[encoded_image_to_pb(image) for image in encoded])

    async def GetInfo(self, request: vision_pb2.VisionInfoRequest, context) -> vision_pb2.VisionInfo:
        return vision_info_to_pb(self.engine.info())
