"""The vision core: processor + encoder cache + encoder + content hash, with no gRPC types and no
threads of its own (engine.py runs it: decoding in worker threads, the encoder on the compute thread).

    sources --byte caps--> content hash (bytes + recipe + encoder revision)
            --cache hit?--> cached rows and grid (no decoding, no encoder)
            --miss--> header only: pixel and frame caps, grid from the resize rule
            --every image inspected--> request pixel budget (misses), token budget (all), the
                                       prompt's context (its other tokens + images + max_tokens)
            --admitted--> cache hits and misses counted
            --misses--> decode + preprocess (processor) --> encoder (misses only, duplicates once)
            --> cache.put --> EncodedImage per source, in order

The grid an image will have is known from its header size: the demo encoder's is fixed
(image_size / patch_size per side); Qwen2-VL's is smart_resize(height, width) / (patch * merge),
the processor's own rule (`qwen2_vl_pixels.smart_resize`), which is symmetric in the two sides, so
EXIF orientation does not change it. A request whose images expand past its token budget, or
overflow the context with the rest of its prompt (`PromptBudget`: the prompt's other tokens as the
decoder counts them, and max_tokens), is refused before a single image is decoded, and its
lookups count as neither cache hits nor misses.

`process` (lookups and PIL decoding) is safe to run concurrently; `encode` touches the model and
must be serialized by the caller (the engine runs it on its one compute thread).
"""

from __future__ import annotations

from services.common.errors import InvalidArgument
from services.vision.config import VisionConfig
from services.vision.encoder import DemoEncoder, ImageEncoder
from services.vision.encoder_cache import EncoderCache
from services.vision.processor import ImageProcessor, ImageSource, content_hash
from services.vision.qwen2_vl_encoder import Qwen2VLEncoder, Qwen2VLEncoderConfig
from services.vision.qwen2_vl_pixels import smart_resize
from services.vision.stats import VisionStats
from services.vision.types import EncodedImage, InspectedImage, PreparedImage, PromptBudget, VisionInfo


def build_encoder(config: VisionConfig) -> ImageEncoder:
    if isinstance(config.encoder, Qwen2VLEncoderConfig):
        return Qwen2VLEncoder(config.encoder)
    return DemoEncoder(config.encoder)


class VisionCore:
    """Blocking: built (weights loaded) and called on the caller's thread."""

    def __init__(self, config: VisionConfig, encoder: ImageEncoder | None = None) -> None:
        self.config = config
        self.processor = ImageProcessor(config.processor)
        self.encoder = encoder or build_encoder(config)
        self.cache = EncoderCache(config.encoder_cache_bytes)
        self.images_encoded = 0
        self.stats = VisionStats(self.encoder.name)

    def process(self, sources: list[ImageSource], max_image_tokens: int = 0,
                prompt: PromptBudget | None = None) -> list[PreparedImage]:
        """Count cap first, then every image's byte and header caps, then the request's budgets
        (pixels of the images to decode; `max_image_tokens` over all, 0 = none; the context the
        images share with the rest of `prompt`, None = not known), then decoding of cache misses only.

        Raises InvalidArgument (naming the image index when a request has several images).
        """
        self.processor.check_count(len(sources))
        inspected = [_indexed(i, len(sources), self.inspect, source) for i, source in enumerate(sources)]
        self.processor.check_request_pixels([item.size for item in inspected if item.size is not None])
        check_image_tokens(inspected, max_image_tokens)
        if prompt is not None:
            check_prompt_context(inspected, prompt)
        for item in inspected:
            self.cache.count(item.content_hash, hit=item.cached is not None)
        return [_indexed(i, len(sources), self._decode, item) for i, item in enumerate(inspected)]

    def inspect(self, source: ImageSource) -> InspectedImage:
        """Byte cap, content hash, cache lookup (not counted: `process` counts admitted requests'); for
        a miss the header checks and the grid to come."""
        data = self.processor.image_bytes(source)  # byte cap, base64 decoding
        key = content_hash(data, self.config.processor, self.encoder.revision)
        cached = self.cache.peek(key)
        if cached is not None:  # same bytes + recipe + weights: already validated and encoded
            return InspectedImage(data=data, content_hash=key, grid_thw=tuple(cached.grid_thw), cached=cached)
        width, height = self.processor.header_size(data)
        return InspectedImage(data=data, content_hash=key, grid_thw=self.grid_for(width, height),
                              size=(width, height))

    def grid_for(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) in LLM units an image of this header size is encoded to (see the module docstring)."""
        qwen = self.config.processor.qwen2_vl
        if qwen is None:
            return self.config.encoder.grid_thw
        resized_h, resized_w = smart_resize(height, width, qwen)
        return (1, resized_h // qwen.factor, resized_w // qwen.factor)

    def _decode(self, item: InspectedImage) -> PreparedImage:
        if item.cached is not None:
            return PreparedImage(content_hash=item.content_hash, cached=item.cached)
        return PreparedImage(content_hash=item.content_hash,
                             processed=self.processor.process(ImageSource(data=item.data)))

    def encode(self, prepared: list[PreparedImage]) -> list[EncodedImage]:
        """Rows for every prepared image, in order; the encoder runs once per distinct missing hash."""
        outputs = {p.content_hash: p.cached for p in prepared if p.cached is not None}
        misses = {p.content_hash: p.processed for p in prepared if p.content_hash not in outputs}
        if misses:
            encoded = self.stats.timed(self.encoder.encode, [p.pixels for p in misses.values()])
            self.images_encoded += len(encoded)
            for key, output in zip(misses, encoded, strict=True):
                self.cache.put(key, output)
                outputs[key] = output
        return [EncodedImage(rows=outputs[p.content_hash].rows, grid_thw=outputs[p.content_hash].grid_thw,
                             mrope_section=self.config.mrope_section, content_hash=p.content_hash)
                for p in prepared]

    def info(self) -> VisionInfo:
        p = self.config.processor
        qwen = p.qwen2_vl
        patch = qwen.patch_size if qwen is not None else self.config.encoder.patch_size
        return VisionInfo(encoder=self.encoder.name, revision=self.encoder.revision,
                          output_width=self.encoder.output_width,
                          image_size=0 if qwen is not None else p.image_size, patch_size=patch,
                          max_image_bytes=p.max_image_bytes, max_image_pixels=p.max_image_pixels,
                          max_images_per_request=p.max_images, mrope_section=self.config.mrope_section,
                          min_pixels=qwen.min_pixels if qwen else 0, max_pixels=qwen.max_pixels if qwen else 0,
                          cache=self.cache.stats(), images_encoded=self.images_encoded)


def check_image_tokens(images: list[InspectedImage], max_image_tokens: int) -> None:
    """Raises InvalidArgument when the images expand past `max_image_tokens` (0 = no budget)."""
    total = sum(image.num_tokens for image in images)
    if max_image_tokens and total > max_image_tokens:
        shown = ", ".join("x".join(map(str, image.grid_thw)) for image in images[:8])
        more = ", ..." if len(images) > 8 else ""
        raise InvalidArgument(f"{len(images)} images expand to {total} tokens (grids {shown}{more}); the budget is "
                              f"{max_image_tokens} (max_image_tokens: the decoder's context less max_tokens)")


def check_prompt_context(images: list[InspectedImage], prompt: PromptBudget) -> None:
    """Raises InvalidArgument when the prompt's other tokens, the images' and max_tokens (at least
    one generated token when unset) pass the context, with the decoder's own wording."""
    num_image_tokens = sum(image.num_tokens for image in images)
    num_prompt = prompt.num_text_tokens + num_image_tokens
    if num_prompt + max(prompt.max_tokens, 1) <= prompt.max_model_len:
        return
    shown = ", ".join("x".join(map(str, image.grid_thw)) for image in images[:8]) + (", ..." if len(images) > 8 else "")
    parts = (f"prompt has {num_prompt} tokens after image expansion ({prompt.num_text_tokens} of text and template, "
             f"{num_image_tokens} for {len(images)} images of grids {shown})")
    if prompt.max_tokens:
        raise InvalidArgument(f"{parts} and max_tokens {prompt.max_tokens}; the model's context is {prompt.max_model_len}")
    raise InvalidArgument(f"{parts}; the model's context is {prompt.max_model_len}, which leaves no room to "
                          "generate a token")


def _indexed(index: int, count: int, step, item):
    """`step(item)`, its InvalidArgument prefixed with the image index when a request has several."""
    try:
        return step(item)
    except InvalidArgument as error:
        if count > 1:
            raise InvalidArgument(f"image {index}: {error}") from error
        raise
