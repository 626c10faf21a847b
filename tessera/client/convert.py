"""protobuf <-> the client's types: request builders and result readers, shared by Client and AsyncClient."""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import json
import os
import typing
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from tessera.client.types import (
    CONSTRAINTS,
    Choice,
    ClusterInfo,
    Content,
    EmbedResult,
    GenerateDelta,
    GenerateResult,
    ImageLike,
    Message,
    RerankItem,
    RerankResult,
    SamplingParams,
    Token,
    TokenizeResult,
    TokenLogprob,
    Usage,
)
from tessera.v1 import decoder_pb2, pooling_pb2, tensor_pb2, vision_pb2

_NUMPY_DTYPES = {"float32": "<f4", "float16": "<f2", "float64": "<f8", "int64": "<i8", "int32": "<i4",
                 "int8": "i1", "uint8": "u1", "bool": "?"}


@functools.cache
def _hints(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def from_pb(cls, message):
    """The dataclass `cls` filled from the same-named fields of `message`, recursively.

    A nested dataclass field typed `X | None` is None when the message field is unset.
    """
    values = {}
    for f in dataclasses.fields(cls):
        hint = _hints(cls)[f.name]
        value = getattr(message, f.name)
        args = typing.get_args(hint)
        inner = next((a for a in args if dataclasses.is_dataclass(a)), None)
        if dataclasses.is_dataclass(hint):
            values[f.name] = from_pb(hint, value)
        elif inner is not None and type(None) in args:
            values[f.name] = from_pb(inner, value) if message.HasField(f.name) else None
        elif typing.get_origin(hint) is list:
            values[f.name] = [from_pb(inner, v) for v in value] if inner is not None else list(value)
        elif typing.get_origin(hint) is dict:
            values[f.name] = dict(value)
        else:
            values[f.name] = value
    return cls(**values)


def tensor_to_numpy(tensor: tensor_pb2.Tensor) -> np.ndarray:
    """A wire tensor as a numpy array of its shape (little-endian C order; bfloat16 is not supported)."""
    if tensor.dtype not in _NUMPY_DTYPES:
        raise ValueError(f"tensor dtype {tensor.dtype!r} has no numpy equivalent")
    return np.frombuffer(tensor.data, dtype=_NUMPY_DTYPES[tensor.dtype]).reshape(tuple(tensor.shape)).copy()


def base64_to_vector(text: str) -> np.ndarray:
    """One base64 little-endian float32 embedding as a [D] float32 array."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4").astype(np.float32)


# --- requests ---------------------------------------------------------------------------------

def image_part(image: ImageLike) -> decoder_pb2.ContentPart:
    """A content part for raw bytes, a file path or a PIL image (encoded as PNG).

    Raises:
        TypeError: anything else.
    """
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    elif isinstance(image, (str, os.PathLike)):
        data = Path(image).read_bytes()
    elif hasattr(image, "save") and hasattr(image, "mode"):  # PIL.Image.Image, without importing PIL
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = buffer.getvalue()
    else:
        raise TypeError(f"an image is bytes, a path or a PIL image; got {type(image).__name__}")
    return decoder_pb2.ContentPart(image=vision_pb2.ImageInput(data=data))


_PART_KEYS = {"text": {"type", "text"}, "image_url": {"type", "image_url"}}


def openai_part(part: dict) -> decoder_pb2.ContentPart:
    """An OpenAI chat content part: `{"type": "text", "text": ...}` or `{"type": "image_url",
    "image_url": {"url": "data:image/png;base64,..."}}` (OpenAI's shape; the vision service decodes
    the data URI, as it does for the HTTP API's). `detail` may be "auto" (the processor's own
    resize, which is what tessera does); remote URLs are never fetched.

    Raises:
        ValueError: an unknown part type (named), a key the part type does not have, text that is
            not a str, an image URL that is not a base64 data URI, a `detail` other than "auto".
    """
    kind = part.get("type")
    if kind not in _PART_KEYS:
        raise ValueError(f"content part type {kind!r} is not supported; the types are {sorted(_PART_KEYS)}")
    unknown = sorted(set(part) - _PART_KEYS[kind])
    if unknown:
        raise ValueError(f"a {kind!r} content part has no field {unknown[0]!r}; its fields are "
                         f"{sorted(_PART_KEYS[kind])}")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f"a 'text' content part needs text as a str; got {type(part.get('text')).__name__}")
        return decoder_pb2.ContentPart(text=part["text"])
    image_url = part.get("image_url")
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise ValueError('an \'image_url\' content part needs "image_url": {"url": "data:image/...;base64,..."}')
    unknown = sorted(set(image_url) - {"url", "detail"})
    if unknown:
        raise ValueError(f"image_url has no field {unknown[0]!r}; its fields are ['detail', 'url']")
    if image_url.get("detail", "auto") != "auto":
        raise ValueError(f"image_url.detail {image_url['detail']!r} is not honoured; images are sized by the "
                         "model's processor (detail 'auto')")
    url = image_url["url"]
    if not url.startswith("data:") or ";base64," not in url[:256]:
        raise ValueError(f"image_url.url must be a base64 data URI (data:image/png;base64,...); remote URLs are "
                         f"not fetched (got {url[:40]!r})")
    return decoder_pb2.ContentPart(image=vision_pb2.ImageInput(data_uri=url))


def content_parts(content: Content) -> list[decoder_pb2.ContentPart]:
    """Message content as parts: a str is text; in a list, a str item is text, a dict an OpenAI
    content part (`openai_part`), anything else an image (`image_part`)."""
    if isinstance(content, str):
        return [decoder_pb2.ContentPart(text=content)]
    return [decoder_pb2.ContentPart(text=p) if isinstance(p, str) else openai_part(p) if isinstance(p, dict)
            else image_part(p) for p in content]


_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
_TEMPLATE_FIELDS = "the chat template is given each message's role, content, name and tool calls only"
# OpenAI's message keys tessera does not take, and why (as the HTTP API refuses them); None asks
# for nothing and passes.
_REFUSED_MESSAGE_KEYS = {"function_call": "OpenAI's deprecated function calling: send tool_calls",
                         "audio": "audio is not supported: the decoder reads text and images",
                         "refusal": _TEMPLATE_FIELDS, "reasoning_content": _TEMPLATE_FIELDS,
                         "reasoning": _TEMPLATE_FIELDS}


def _message_fields(message: Message | dict, where: str) -> tuple[str, Content, str | None]:
    """(role, content, name) of a `Message` or an OpenAI-style dict (an assistant's content may be
    null beside tool_calls: "").

    Raises:
        ValueError: naming the key: one a message does not have, one tessera does not take
            (`function_call`, ...), a missing or null role or content, a role or name that is not a str.
    """
    if isinstance(message, dict):
        for key, value in message.items():
            if key in _REFUSED_MESSAGE_KEYS:
                if value is not None:
                    raise ValueError(f"{where}.{key} is not supported: {_REFUSED_MESSAGE_KEYS[key]}")
            elif key not in _MESSAGE_KEYS:
                raise ValueError(f"{where} has no field {key!r}; a message's fields are {list(_MESSAGE_KEYS)}")
        role, content, name = message.get("role"), message.get("content"), message.get("name")
        if content is None and message.get("tool_calls"):
            content = ""
    else:
        role, content, name = message.role, message.content, message.name
    if not isinstance(role, str):
        raise ValueError(f"{where}.role must be a str (\"system\", \"user\", \"assistant\" or \"tool\"); got "
                         f"{type(role).__name__}")
    if content is None:
        raise ValueError(f"{where}.content is missing: a message needs its text, or a list of parts")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{where}.name must be a str; got {type(name).__name__}")
    return role, content, name


def _tool_calls(message: Message | dict, where: str) -> list[decoder_pb2.ToolCall]:
    """An OpenAI-style message's tool_calls ([{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}]) as ToolCalls. Raises ValueError naming the entry of another shape."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    out = []
    for j, call in enumerate(calls or ()):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(function.get("arguments", ""), str) or call.get("type", "function") != "function":
            raise ValueError(f"{where}.tool_calls[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                             "{\"name\": str, \"arguments\": JSON text}}")
        out.append(decoder_pb2.ToolCall(id=str(call.get("id") or ""), name=function["name"],
                                        arguments=function.get("arguments", "")))
    return out


def chat_messages(messages: Iterable[Message | dict]) -> list[decoder_pb2.ChatMessage]:
    """Messages as `Message`s or OpenAI-style dicts with "role", "content" and optionally "name",
    "tool_calls" (an assistant's) and "tool_call_id" (a "tool" message's).

    Raises:
        ValueError: a message `_message_fields` refuses, a tool call of another shape, or a
            content part `openai_part` refuses.
    """
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role, content, name = _message_fields(message, where)
        call_id = message.get("tool_call_id") if isinstance(message, dict) else None
        out.append(decoder_pb2.ChatMessage(role=role, content=content_parts(content), name=name or "",
                                           tool_call_id=str(call_id or ""), tool_calls=_tool_calls(message, where)))
    return out


def sampling_params(params: SamplingParams) -> decoder_pb2.SamplingParams:
    fields = dataclasses.asdict(params)
    seed = fields.pop("seed")
    constraint = {name: fields.pop(name) for name in CONSTRAINTS}
    fields["max_tokens"] = fields["max_tokens"] or 0  # 0 on the wire: the rest of the context
    sampling = decoder_pb2.SamplingParams(**{k: list(v) if isinstance(v, tuple | list) else v
                                             for k, v in fields.items()})
    if seed is not None:
        sampling.seed = seed
    _set_constraint(sampling, **constraint)
    return sampling


def _set_constraint(sampling: decoder_pb2.SamplingParams, json_schema, json_object: bool, regex, choice,
                    grammar) -> None:
    """SamplingParams' `constraint` oneof from the client's fields (at most one is set: SamplingParams
    checks it)."""
    if json_schema is not None:
        sampling.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif json_object:
        sampling.json_object = True
    elif regex is not None:
        sampling.regex = regex
    elif choice is not None:
        sampling.choice.SetInParent()  # set even when empty: the decoder refuses an empty list, naming it
        sampling.choice.choices.extend(choice)
    elif grammar is not None:
        sampling.grammar = grammar


def generate_request(*, prompt: str | Sequence[int] | None = None, messages: Iterable[Message | dict] | None = None,
                     images: Sequence[ImageLike] = (), lora: str = "", request_id: str | None = None,
                     sampling: SamplingParams, tools: Sequence[dict] = ()) -> decoder_pb2.GenerateRequest:
    """A raw prompt (text, or token ids), or chat messages. `images` go before a text prompt's text;
    `tools` (OpenAI's tool objects) go to the chat template with messages."""
    request = decoder_pb2.GenerateRequest(request_id=request_id or uuid.uuid4().hex,
                                          sampling=sampling_params(sampling), lora=lora)
    if tools:
        if messages is None:
            raise ValueError("tools go with chat messages (the chat template renders them)")
        request.tools = json.dumps(list(tools))
    if messages is not None:
        request.messages.extend(chat_messages(messages))
    elif images and not isinstance(prompt, str):
        raise ValueError("images go with a text prompt; token ids have no place for them")
    elif isinstance(prompt, str):
        request.prompt.extend([image_part(i) for i in images] + [decoder_pb2.ContentPart(text=prompt)])
    else:
        request.prompt_token_ids.extend(prompt)
    return request


_DIRECTIONS = {"right": pooling_pb2.TRUNCATION_DIRECTION_RIGHT, "left": pooling_pb2.TRUNCATION_DIRECTION_LEFT}


def truncation_direction(name: str) -> int:
    """"right" (keep the first tokens) or "left" (the last), either case as TEI takes them, as the
    protobuf enum; ValueError otherwise."""
    if not isinstance(name, str) or name.lower() not in _DIRECTIONS:
        raise ValueError(f"truncation_direction is 'right' or 'left'; got {name!r}")
    return _DIRECTIONS[name.lower()]


def embed_request(inputs: str | Sequence[str] | None, *, input_ids: Sequence[Sequence[int]] | None, model: str,
                  normalize: bool | None, dimensions: int | None, truncate: bool, prompt_name: str,
                  encoding_format: str, direction: str = "right") -> pooling_pb2.EmbedRequest:
    if encoding_format not in ("float", "base64"):
        raise ValueError(f"encoding_format is 'float' or 'base64'; got {encoding_format!r}")
    request = pooling_pb2.EmbedRequest(
        model=model, truncate=truncate, prompt_name=prompt_name, truncation_direction=truncation_direction(direction),
        encoding_format=pooling_pb2.ENCODING_FORMAT_BASE64 if encoding_format == "base64"
        else pooling_pb2.ENCODING_FORMAT_FLOAT)
    if input_ids is not None:
        request.input_ids.extend(pooling_pb2.TokenIds(ids=list(ids)) for ids in input_ids)
    else:
        request.inputs.extend([inputs] if isinstance(inputs, str) else list(inputs or ()))
    if normalize is not None:
        request.normalize = normalize
    if dimensions is not None:
        request.dimensions = dimensions
    return request


def rerank_request(query: str, documents: Sequence[str], *, top_n: int | None, return_documents: bool,
                   model: str, raw_scores: bool, truncate: bool = False,
                   direction: str = "right") -> pooling_pb2.RerankRequest:
    request = pooling_pb2.RerankRequest(query=query, documents=list(documents), return_documents=return_documents,
                                        model=model, raw_scores=raw_scores, truncate=truncate,
                                        truncation_direction=truncation_direction(direction))
    if top_n is not None:
        request.top_n = top_n
    return request


# --- results ----------------------------------------------------------------------------------

def generate_delta(response: decoder_pb2.GenerateResponse) -> GenerateDelta:
    return GenerateDelta(index=response.index, text=response.text, token_ids=list(response.token_ids),
                         finish_reason=response.finish_reason,
                         logprobs=[from_pb(TokenLogprob, p) for p in response.logprobs])


class ResultBuilder:
    """Gathers a Generate's streamed messages into its GenerateResult."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.replica = ""
        self._texts: dict[int, list[str]] = {}
        self._ids: dict[int, list[int]] = {}
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self._finish: dict[int, str] = {}
        self._usages: dict[int, Usage] = {}  # choice index -> its final message's usage

    def add(self, response: decoder_pb2.GenerateResponse) -> GenerateDelta:
        delta = generate_delta(response)
        self._texts.setdefault(delta.index, []).append(delta.text)
        self._ids.setdefault(delta.index, []).extend(delta.token_ids)
        self._logprobs.setdefault(delta.index, []).extend(delta.logprobs)
        if delta.finish_reason:
            self._finish[delta.index] = delta.finish_reason
        if response.HasField("usage"):
            self._usages[delta.index] = from_pb(Usage, response.usage)
        return delta

    def usage(self) -> Usage:
        """The request's usage, as OpenAI's and vLLM's for n choices: completion tokens summed over
        the choices, the prompt counted once. The decoder reports each choice's own usage on its
        final message (tessera/v1/decoder.proto); the prompt's counts are the lowest choice's, choice
        0: it computes the prompt (its prefix-cache hits), the others reuse its blocks."""
        if not self._usages:
            return Usage()
        first = self._usages[min(self._usages)]
        completion = sum(u.completion_tokens for u in self._usages.values())
        return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=completion,
                     total_tokens=first.prompt_tokens + completion, image_tokens=first.image_tokens,
                     cached_prompt_tokens=first.cached_prompt_tokens)

    def result(self) -> GenerateResult:
        choices = [Choice(index=i, text="".join(self._texts[i]), token_ids=self._ids[i],
                          finish_reason=self._finish.get(i, ""), logprobs=self._logprobs[i])
                   for i in sorted(self._texts)]
        return GenerateResult(request_id=self.request_id, choices=choices or [Choice(0, "", [], "")],
                              usage=self.usage(), replica=self.replica)


def embed_result(response: pooling_pb2.EmbedResponse) -> EmbedResult:
    if response.embeddings_base64:
        vectors = np.stack([base64_to_vector(text) for text in response.embeddings_base64])
    else:
        vectors = tensor_to_numpy(response.embeddings).astype(np.float32, copy=False)
    return EmbedResult(model=response.model, embeddings=vectors, prompt_tokens=response.usage.prompt_tokens)


def rerank_result(response: pooling_pb2.RerankResponse) -> RerankResult:
    return RerankResult(model=response.model, method=response.method,
                        results=[from_pb(RerankItem, r) for r in response.results])


def tokenize_request(inputs: str | Sequence[str] | None, *, messages: Iterable[Message | dict] | None, model: str,
                     add_special_tokens: bool | None, prompt_name: str) -> pooling_pb2.TokenizeRequest:
    """Texts (or, for a decoder model, chat messages); `add_special_tokens` None = the server's default."""
    texts = [] if inputs is None else [inputs] if isinstance(inputs, str) else list(inputs)
    request = pooling_pb2.TokenizeRequest(model=model, inputs=texts, prompt_name=prompt_name,
                                          messages=chat_messages(messages or ()))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def tokenize_result(response: pooling_pb2.TokenizeResponse) -> TokenizeResult:
    return TokenizeResult(model=response.model, max_model_len=response.max_model_len,
                          tokens=[[from_pb(Token, t) for t in r.tokens] for r in response.results])


def cluster_info(response) -> ClusterInfo:
    return from_pb(ClusterInfo, response)
