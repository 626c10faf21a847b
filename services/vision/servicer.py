"""`tessera.v1.Vision` servicer: protobuf in -> engine -> protobuf out.

The engine (encoder weights) is built in `start`, which `serve` awaits before health says
SERVING. Decoding runs in worker threads (concurrently); the encoder loads and runs on the
process's compute thread (services/common/compute.py), one batch at a time, so the event loop
keeps answering health checks while a batch encodes.

An encode that raises an error fails its request only. One that ends with a fatal error (a
BaseException that is not an Exception: the encoder can no longer be trusted) stops the encoder:
that and every later request fail with UNAVAILABLE naming the cause, and `health()` says so, as it
does when encodes are waiting and none completes within `wedged_after_s` (services/common/liveness.py).
"""

from __future__ import annotations

import asyncio
import logging

from services.common.compute import shared_compute_thread
from services.common.errors import InvalidArgument, Unavailable
from services.common.liveness import Liveness
from services.vision.config import VisionConfig
from services.vision.convert import encoded_image_to_pb, image_source_from_pb, vision_info_to_pb
from services.vision.engine import VisionEngine
from tessera.v1 import vision_pb2, vision_pb2_grpc

log = logging.getLogger(__name__)


class VisionServicer(vision_pb2_grpc.VisionServicer):
    def __init__(self, config: VisionConfig) -> None:
        self.config = config
        self._engine: VisionEngine | None = None
        self._compute = shared_compute_thread()
        self.liveness = Liveness("the vision encoder", config.wedged_after_s)
        self._num_encoding = 0  # requests inside `_encode`: waiting for, or on, the compute thread

    async def start(self) -> None:
        self._engine = await self._compute.run(VisionEngine, self.config)

    def health(self) -> str | None:
        """None while the encoder works (or is still loading); else why not."""
        return self.liveness.check(self._num_encoding > 0)

    async def _encode(self, engine: VisionEngine, prepared: list) -> list:
        self.liveness.raise_if_dead()
        self._num_encoding += 1
        try:
            encoded = await self._compute.run(engine.encode, prepared)
        except asyncio.CancelledError:  # the caller gave up; the encode may still be running: no progress
            raise
        except Exception:  # this request only; the encoder finished a step
            self.liveness.num_steps += 1
            raise
        except BaseException as cause:  # noqa: BLE001 - fatal: the encoder stops serving
            log.critical("the vision encoder stopped", exc_info=cause)
            self.liveness.die(cause)
            raise self.liveness.dead_error() from cause
        finally:
            self._num_encoding -= 1
        self.liveness.num_steps += 1
        return encoded

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
        encoded = await self._encode(engine, prepared)
        return vision_pb2.EncodeImagesResponse(images=[encoded_image_to_pb(image) for image in encoded])

    async def GetInfo(self, request: vision_pb2.VisionInfoRequest, context) -> vision_pb2.VisionInfo:
        return vision_info_to_pb(self.engine.info())
