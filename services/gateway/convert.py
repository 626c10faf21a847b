"""Protobuf -> the routing policies' domain types (services/gateway/routing/), and the gateway's Tokenize
to and from the decoder's."""

from __future__ import annotations

import struct

from services.common.errors import InvalidArgument
from services.gateway.routing import RoutingKey
from tessera.v1 import decoder_pb2, pooling_pb2, vision_pb2

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


def served_names(info: decoder_pb2.DecoderInfo) -> list[str]:
    """Every name the decoder's model answers to, the one its answers carry first:
    DecoderInfo.served_model_names (--served-model-name), else its `model` alone."""
    return list(info.served_model_names) or [info.model]


def decoder_tokenize_request(request: pooling_pb2.TokenizeRequest,
                             model: str) -> decoder_pb2.DecoderTokenizeRequest:
    """A Tokenize for the decoder's tokenizer as the decoder's request: its one input or its
    messages, and their chat fields. `model` (the decoder's name or the adapter's the request
    resolved to) is what refusals name.

    Raises:
        InvalidArgument: more than one input, or a prompt_name (pooling models' prompts).
    """
    if len(request.inputs) > 1:
        raise InvalidArgument(f"inputs has {len(request.inputs)} texts; the decoder's model {model!r} "
                              "tokenizes one text (or messages) per request")
    if request.prompt_name:
        raise InvalidArgument(f"prompt_name is for pooling models; {model!r} is a decoder model")
    out = decoder_pb2.DecoderTokenizeRequest(text=request.inputs[0] if request.inputs else "",
                                             messages=request.messages,
                                             continue_final_message=request.continue_final_message,
                                             chat_template_kwargs=request.chat_template_kwargs, tools=request.tools)
    if request.HasField("add_special_tokens"):
        out.add_special_tokens = request.add_special_tokens
    if request.HasField("add_generation_prompt"):
        out.add_generation_prompt = request.add_generation_prompt
    return out


def tokenize_response(model: str, reply: decoder_pb2.DecoderTokenizeResponse) -> pooling_pb2.TokenizeResponse:
    """The decoder's answer in the gateway's shape: one result whose tokens carry id, text and
    special flag (no character offsets), and the context."""
    tokens = [pooling_pb2.Token(id=i, text=t, special=s)
              for i, t, s in zip(reply.token_ids, reply.tokens, reply.special, strict=True)]
    return pooling_pb2.TokenizeResponse(model=model, results=[pooling_pb2.TokenizedInput(tokens=tokens)],
                                        max_model_len=reply.max_model_len)


def without_image_bytes(request: decoder_pb2.GenerateRequest) -> decoder_pb2.GenerateRequest:
    """`request` with every image part's bytes left out (an empty ImageInput keeps its place): what
    the decoder's CountPromptTokens needs, without copying the images."""
    out = decoder_pb2.GenerateRequest()
    for field, value in request.ListFields():
        if field.name in ("prompt", "messages"):
            continue
        if field.is_repeated:
            getattr(out, field.name).extend(value)
        elif field.message_type is not None:
            getattr(out, field.name).CopyFrom(value)
        else:
            setattr(out, field.name, value)

    def bare(part: decoder_pb2.ContentPart) -> decoder_pb2.ContentPart:
        if part.WhichOneof("part") == "image":
            return decoder_pb2.ContentPart(image=vision_pb2.ImageInput())
        return part

    out.prompt.extend(bare(part) for part in request.prompt)
    for message in request.messages:
        out.messages.add(role=message.role, name=message.name, content=[bare(part) for part in message.content])
    return out
