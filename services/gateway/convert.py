"""Protobuf -> the router's domain types (services/gateway/router.py)."""

from __future__ import annotations

import struct

from services.gateway.router import RoutingKey
from tessera.v1 import decoder_pb2

# Separators that cannot occur in UTF-8 text a chat template would distinguish from content
_ROLE_END, _MESSAGE_END, _IMAGE = b"\x1f", b"\x1e", b"\x1d"


def routing_key(request: decoder_pb2.GenerateRequest) -> RoutingKey:
    """The request's canonical content for prefix affinity.

    Chat messages are rendered `role US text... RS` in order, so a conversation's next turn (the
    same messages plus new ones) starts with the previous turn's bytes; a raw prompt is its text
    parts in order; pre-tokenized prompts are their ids as little-endian int32. Each image is a
    one-byte marker whose block is salted with its content hash (set by the vision service).
    """
    content = bytearray()
    images: list[tuple[int, str]] = []

    def parts(items) -> None:
        for part in items:
            kind = part.WhichOneof("part")
            if kind == "text":
                content.extend(part.text.encode())
            elif kind == "encoded_image":
                images.append((len(content), part.encoded_image.content_hash))
                content.extend(_IMAGE)

    if request.messages:
        for message in request.messages:
            content.extend(message.role.encode() + _ROLE_END)
            parts(message.content)
            content.extend(_MESSAGE_END)
    elif request.prompt_token_ids:
        content.extend(struct.pack(f"<{len(request.prompt_token_ids)}i", *request.prompt_token_ids))
    else:
        parts(request.prompt)
    return RoutingKey(bytes(content), request.lora, tuple(images))
