"""Protobuf <-> vision domain types. Only the servicer imports this module; the core never sees stubs."""

from __future__ import annotations

from services.common.errors import InvalidArgument
from services.common.tensor import to_pb
from services.vision.processor import ImageSource
from services.vision.types import EncodedImage, PromptBudget, VisionInfo
from tessera.v1 import vision_pb2


def image_source_from_pb(message: vision_pb2.ImageInput) -> ImageSource:
    """ImageInput -> ImageSource. Raises InvalidArgument when neither oneof field is set."""
    which = message.WhichOneof("source")
    if which == "data":
        return ImageSource(data=message.data)
    if which == "data_uri":
        return ImageSource(data_uri=message.data_uri)
    raise InvalidArgument("ImageInput has neither data nor data_uri set")


def prompt_budget_from_pb(request: vision_pb2.EncodeImagesRequest) -> PromptBudget | None:
    """The request's PromptBudget, None when unset. Raises InvalidArgument for a negative count or no context."""
    if not request.HasField("prompt"):
        return None
    prompt = request.prompt
    return PromptBudget(prompt.num_text_tokens, prompt.max_tokens, prompt.max_model_len)


def encoded_image_to_pb(image: EncodedImage) -> vision_pb2.EncodedImage:
    return vision_pb2.EncodedImage(rows=to_pb(image.rows), grid_thw=list(image.grid_thw),
                                   mrope_section=list(image.mrope_section), content_hash=image.content_hash)


def vision_info_to_pb(info: VisionInfo) -> vision_pb2.VisionInfo:
    return vision_pb2.VisionInfo(
        encoder=info.encoder, revision=info.revision, output_width=info.output_width,
        image_size=info.image_size, patch_size=info.patch_size, max_image_bytes=info.max_image_bytes,
        max_image_pixels=info.max_image_pixels, max_images_per_request=info.max_images_per_request,
        mrope_section=list(info.mrope_section), min_pixels=info.min_pixels, max_pixels=info.max_pixels,
        encoder_cache=vision_pb2.EncoderCacheStats(
            hits=info.cache.hits, misses=info.cache.misses, evictions=info.cache.evictions,
            entries=info.cache.entries, bytes=info.cache.bytes, capacity_bytes=info.cache.capacity_bytes),
        images_encoded=info.images_encoded)
