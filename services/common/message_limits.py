"""The largest request message each service accepts: its gRPC server's receive limit.

Each limit is derived from the service's own caps, so grpc refuses anything bigger with
RESOURCE_EXHAUSTED before it is read into memory, and everything a caller may legitimately send
still arrives and meets the service's own checks (which name the field and its limit). Client
channels keep `tessera.protocol.MAX_MESSAGE_BYTES`: a decoder pulls adapter weights from the registry, the
gateway relays whatever its backends answer.
"""

from __future__ import annotations

MIB = 1 << 20
DEFAULT_MAX_IMAGE_BYTES = 20 * MIB  # compressed bytes of one image (vision's --max-image-bytes default)
FRAMING_BYTES = 1 * MIB             # tags, ids, names and options around a request's payload
TEXT_BYTES = 16 * MIB               # prompt, messages and stop strings of one Generate (4 M UTF-8 characters)
REGISTRY_BYTES = 4 * MIB            # registry requests carry names and paths, never weights
UTF8_MAX_BYTES_PER_CHAR = 4
VARINT_MAX_BYTES = 10               # a negative int32 token id on the wire
FLOAT32_BYTES = 4


def image_wire_bytes(max_image_bytes: int) -> int:
    """One image as sent: raw bytes, or a base64 data URI (4/3 of them plus its header)."""
    return -(-max_image_bytes * 4 // 3) + 256


def pooling_bytes(max_request_chars: int, max_request_token_ids: int) -> int:
    """Embed/Rerank/Tokenize: `max_request_chars` of UTF-8 text, or `max_request_token_ids` token ids."""
    text = max_request_chars * UTF8_MAX_BYTES_PER_CHAR
    token_ids = max_request_token_ids * VARINT_MAX_BYTES
    return max(text, token_ids) + FRAMING_BYTES


def vision_bytes(max_images: int, max_image_bytes: int) -> int:
    """Encode: `max_images` images of `max_image_bytes` each."""
    return max_images * image_wire_bytes(max_image_bytes) + FRAMING_BYTES


def decoder_bytes(max_model_len: int, hidden_size: int) -> int:
    """Generate: image rows filling the whole context ([max_model_len, hidden] float32) plus text."""
    return max_model_len * hidden_size * FLOAT32_BYTES + TEXT_BYTES + FRAMING_BYTES


def gateway_bytes(max_images: int, max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> int:
    """A public request: `max_images` images plus text (Embed's text fits TEXT_BYTES too)."""
    return max_images * image_wire_bytes(max_image_bytes) + TEXT_BYTES + FRAMING_BYTES
