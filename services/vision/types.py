"""Domain types of the vision service: what the engine hands the servicer (no gRPC types here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument
from services.vision.encoder import EncoderOutput
from services.vision.encoder_cache import EncoderCacheStats
from services.vision.processor import ProcessedImage


@dataclass(frozen=True)
class EncodedImage:
    """What the decoder consumes in place of one image placeholder.

    rows: [t*h*w, output_width] float32, (t, h, w) raster order (shared with the encoder cache:
    read-only). grid_thw: (t, h, w) in LLM units. mrope_section: rotary pairs per axis (t, h, w).
    content_hash: sha256 hex of image bytes + preprocessing config + encoder revision.
    """

    rows: torch.Tensor
    grid_thw: tuple[int, int, int]
    mrope_section: tuple[int, int, int]
    content_hash: str


@dataclass(frozen=True)
class PromptBudget:
    """What a request's images share the decoder's context with: the prompt's other tokens (text,
    chat template, vision start/end, as the decoder counts them), `max_tokens` (0 = unset: room for
    one generated token) and the context `max_model_len`, all in tokens."""

    num_text_tokens: int
    max_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.num_text_tokens < 0 or self.max_tokens < 0 or self.max_model_len < 1:
            raise InvalidArgument(f"prompt budget needs num_text_tokens >= 0, max_tokens >= 0 and max_model_len >= 1, "
                                  f"got {self.num_text_tokens}, {self.max_tokens} and {self.max_model_len}",
                                  field="prompt")


@dataclass(frozen=True)
class InspectedImage:
    """One source after its byte and header checks, nothing decoded yet.

    `size`: (width, height) from the header, None for a cache hit (nothing to decode);
    `grid_thw`: what the encoder will make of it, in LLM units.
    """

    data: bytes
    content_hash: str
    grid_thw: tuple[int, int, int]
    size: tuple[int, int] | None = None
    cached: EncoderOutput | None = None

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


@dataclass(frozen=True)
class PreparedImage:
    """One source after `process`: its content hash and either cached rows or decoded pixels."""

    content_hash: str
    cached: EncoderOutput | None = None
    processed: ProcessedImage | None = None


@dataclass(frozen=True)
class VisionInfo:
    encoder: str
    revision: str
    output_width: int
    image_size: int          # fixed side (demo); 0 for Qwen2-VL's dynamic resolution
    patch_size: int
    max_image_bytes: int
    max_image_pixels: int
    max_images_per_request: int
    mrope_section: tuple[int, int, int]
    min_pixels: int          # Qwen2-VL resize bounds (pixels after resizing); 0 for the demo encoder
    max_pixels: int
    cache: EncoderCacheStats
    images_encoded: int      # images that actually ran through the encoder (cache misses)
