"""The vision engine: the `VisionCore` (core.py) run off the event loop, with its liveness.

The core (encoder weights) is built in `start`, which `serve` awaits before health says SERVING,
on the process's compute thread (services/common/compute.py), where every encode then runs, one
batch at a time; decoding runs in worker threads (concurrently), so the event loop keeps answering
health checks while a batch encodes.

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
from services.vision.core import VisionCore
from services.vision.processor import ImageSource
from services.vision.types import EncodedImage, PromptBudget, VisionInfo

log = logging.getLogger(__name__)


class VisionEngine:
    """Encodes images for the decoder: `start()` (the core, on the compute thread), then `encode`.

    Requests before `start` has finished raise Unavailable ("still loading").
    """

    def __init__(self, config: VisionConfig) -> None:
        self.config = config
        self.compute = shared_compute_thread()
        self.liveness = Liveness("the vision encoder", config.wedged_after_s)
        self.core: VisionCore | None = None
        self._num_encoding = 0  # requests inside `encode`: waiting for, or on, the compute thread

    async def start(self) -> None:
        """Build the core (processor, cache, encoder weights) on the compute thread.

        Raises:
            ValueError: the encoder cannot be built as configured.
        """
        self.core = await self.compute.run(VisionCore, self.config)

    async def stop(self) -> None:
        """Nothing to release: the compute thread is the process's."""

    def health(self) -> str | None:
        """None while the encoder works (or is still loading); else why not."""
        return self.liveness.check(self._num_encoding > 0)

    def _loaded(self) -> VisionCore:
        if self.core is None:
            raise Unavailable("the vision encoder is still loading")
        return self.core

    def check_count(self, num_images: int) -> None:
        """The request's image count cap, checked before any image is read.

        Raises:
            InvalidArgument: more images than the cap.
            Unavailable: still loading.
        """
        self._loaded().processor.check_count(num_images)

    async def encode(self, sources: list[ImageSource], max_image_tokens: int = 0,
                     prompt: PromptBudget | None = None) -> list[EncodedImage]:
        """Rows for every image, in order (core.py `process`, then `encode` on the compute thread).

        Raises:
            InvalidArgument: past a cap, the token budget (`max_image_tokens`: 0 = none) or the
                context the images share with the rest of `prompt` (None: not known), or not an image.
            Unavailable: still loading, or the encoder has stopped.
        """
        core = self._loaded()
        if max_image_tokens < 0:
            raise InvalidArgument(f"max_image_tokens must be >= 0 (0 = no budget), got {max_image_tokens}")
        # headers and budgets before any decoding; encoder-cache hits skip decoding
        prepared = await asyncio.to_thread(core.process, sources, max_image_tokens, prompt)
        self.liveness.raise_if_dead()
        self._num_encoding += 1
        try:
            encoded = await self.compute.run(core.encode, prepared)
        except asyncio.CancelledError:  # the caller gave up; the encode may still be running: no progress
            raise
        except Exception:  # this request only; the encoder finished a step
            self.liveness.num_steps += 1
            raise
        except BaseException as cause:  # fatal: the encoder stops serving
            log.critical("the vision encoder stopped", exc_info=cause)
            self.liveness.die(cause)
            raise self.liveness.dead_error() from cause
        finally:
            self._num_encoding -= 1
        self.liveness.num_steps += 1
        return encoded

    def info(self) -> VisionInfo:
        return self._loaded().info()
