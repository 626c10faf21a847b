"""The vision engine: processor + encoder + content hash, with no gRPC types.

`process` (PIL decoding) is safe to run concurrently; `encode` touches the model and must be
serialized by the caller (the servicer holds a lock and runs both off the event loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument
from services.vision.config import VisionConfig
from services.vision.encoder import DemoEncoder, ImageEncoder
from services.vision.processor import ImageProcessor, ImageSource, ProcessedImage, content_hash


@dataclass(frozen=True)
class EncodedImage:
    """What the decoder consumes in place of one image placeholder.

    rows: [t*h*w, output_width] float32, (t, h, w) raster order.
    grid_thw: (t, h, w) in LLM units. mrope_section: rotary pairs per axis (t, h, w).
    content_hash: sha256 hex of image bytes + preprocessing config + encoder revision.
    """

    rows: torch.Tensor
    grid_thw: tuple[int, int, int]
    mrope_section: tuple[int, int, int]
    content_hash: str


@dataclass(frozen=True)
class VisionInfo:
    encoder: str
    revision: str
    output_width: int
    image_size: int
    patch_size: int
    max_image_bytes: int
    max_image_pixels: int
    max_images_per_request: int
    mrope_section: tuple[int, int, int]


class VisionEngine:
    def __init__(self, config: VisionConfig, encoder: ImageEncoder | None = None) -> None:
        self.config = config
        self.processor = ImageProcessor(config.processor)
        self.encoder = encoder or DemoEncoder(config.encoder)

    def process(self, sources: list[ImageSource]) -> list[ProcessedImage]:
        """Count cap first, then each image's caps. Raises InvalidArgument naming the image index."""
        self.processor.check_count(len(sources))
        processed = []
        for i, source in enumerate(sources):
            try:
                processed.append(self.processor.process(source))
            except InvalidArgument as error:
                if len(sources) > 1:
                    raise InvalidArgument(f"image {i}: {error}") from error
                raise
        return processed

    def encode(self, processed: list[ProcessedImage]) -> list[EncodedImage]:
        """Run the encoder on processed images; one `EncodedImage` per input, in order."""
        outputs = self.encoder.encode([p.pixels for p in processed])
        revision = self.encoder.revision
        return [
            EncodedImage(rows=out.rows, grid_thw=out.grid_thw, mrope_section=self.config.mrope_section,
                         content_hash=content_hash(p.image_bytes, self.config.processor, revision))
            for p, out in zip(processed, outputs, strict=True)
        ]

    def info(self) -> VisionInfo:
        p, e = self.config.processor, self.config.encoder
        return VisionInfo(encoder=self.encoder.name, revision=self.encoder.revision,
                          output_width=self.encoder.output_width, image_size=p.image_size,
                          patch_size=e.patch_size, max_image_bytes=p.max_image_bytes,
                          max_image_pixels=p.max_image_pixels, max_images_per_request=p.max_images,
                          mrope_section=self.config.mrope_section)
