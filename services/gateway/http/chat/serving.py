"""Chat and text completions: HTTP bodies (protocol.py) -> the core's GenerateRequests, and the
answer, whole or streamed (generate.py), with refusals naming the body's fields.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from services.common.errors import TesseraError
from services.gateway.http.backend import Backend
from services.gateway.http.chat import generate, structured
from services.gateway.http.chat.generate import Shape
from services.gateway.http.chat.protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    TextPart,
)
from services.gateway.http.chat.tools import DecoderTools, ToolPlan, constraint, schema_field, tools_text
from services.gateway.http.errors import ApiError, from_error
from services.gateway.http.tokenize.protocol import TokenizeRequest
from tessera.protocol import UNKNOWN_ADAPTER
from tessera.v1 import decoder_pb2

_DATA_URI_PREFIX = "data:"

# SamplingParams' optional fields: left unset when the body leaves them out, so the served model's
# generation-config defaults apply (decoder.proto)
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "skip_special_tokens",
                      "spaces_between_special_tokens")
DEFAULT_TEMPERATURE = 1.0  # OpenAI's, when neither the request nor the model's generation config sets one


def _check_image_url(url: str, where: str) -> None:
    if not url.startswith(_DATA_URI_PREFIX) or ";base64," not in url[:256]:
        raise ApiError(400, f"{where}.image_url.url must be a base64 data URI (data:image/png;base64,...); "
                            f"remote URLs are not fetched by the gateway (got {url[:40]!r})", param=f"{where}.image_url")


def chat_messages(messages: list[ChatMessage], into=None, images: list | None = None) -> list[decoder_pb2.ChatMessage]:
    """OpenAI messages -> ChatMessage protos; each `image_url` part becomes an `image` part.

    Built in place, so an image's data URI is copied once (a proto passed to a constructor is
    copied whole): into `into` (a repeated ChatMessage field; default a new list's worth); with
    `images` given, image parts are left empty and `(part, url)` pairs appended to it for the caller
    to fill (`fill_images`) once the request's caps have been checked.

    Raises:
        ApiError: 400 for an image that is not a base64 data URI (remote URLs are never fetched).
    """
    holder = decoder_pb2.GenerateRequest() if into is None else None
    into = holder.messages if into is None else into
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role  # OpenAI's new name for system
        out = into.add(role=role, name=message.name or "", tool_call_id=message.tool_call_id or "")
        for call in message.tool_calls or ():
            out.tool_calls.add(id=call.id, name=call.function.name, arguments=call.function.arguments)
        content = message.content
        if isinstance(content, str):
            out.content.add(text=content)
        elif content is not None:
            for j, p in enumerate(content):
                if isinstance(p, TextPart):
                    out.content.add(text=p.text)
                    continue
                _check_image_url(p.image_url.url, f"messages.{i}.content.{j}")
                image = out.content.add().image
                if images is None:
                    image.data_uri = p.image_url.url
                else:
                    image.SetInParent()  # an image part; its bytes come in fill_images
                    images.append((image, p.image_url.url))
    return list(into) if holder is not None else into


def fill_images(images: list) -> None:
    """The data URIs `chat_messages` left out, each copied once into its part."""
    for image, url in images:
        image.data_uri = url


def _stream_fields(body: SamplingFields) -> None:
    """Raises ApiError 400 for stream_options without stream (as OpenAI) and prompt_logprobs with
    stream (as vLLM: they are not streamed)."""
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(400, "prompt_logprobs are not available when stream is true (as vLLM)", param="prompt_logprobs")


def sampling(body: SamplingFields, max_tokens: int, logprobs: bool, top_logprobs: int,
             prompt_logprobs: int | None) -> decoder_pb2.SamplingParams:
    """The body's sampling fields as SamplingParams; a field the body leaves out stays unset (the
    model's generation-config default applies), and `default_temperature` is OpenAI's 1. The body's
    structured-output constraint fills the `constraint` oneof (structured.py).

    Raises:
        ApiError: 400 for a logit_bias key that is not a token id, an empty allowed_token_ids, or two
            output constraints."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = decoder_pb2.SamplingParams(
        max_tokens=max_tokens, stop=stop, n=body.n, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logprobs=logprobs, top_logprobs=top_logprobs,
        stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output, default_temperature=DEFAULT_TEMPERATURE,
        logit_bias=_logit_bias(body.logit_bias), bad_words=body.bad_words or [])
    if body.allowed_token_ids is not None:
        if not body.allowed_token_ids:  # empty on the wire means "every id": refused, as vLLM refuses it
            raise ApiError(400, "allowed_token_ids must not be empty (leave it out to allow every token)",
                           param="allowed_token_ids")
        params.allowed_token_ids.extend(body.allowed_token_ids)
    for name in _OPTIONAL_SAMPLING:
        value = getattr(body, name)
        if value is not None:
            setattr(params, name, value)
    if prompt_logprobs is not None:
        params.prompt_logprobs = prompt_logprobs
    structured.apply(body, params)
    return params


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (JSON keys: token ids as strings of digits) by token id; the values'
    range is the decoder's check.

    Raises:
        ApiError: 400 naming logit_bias for a key that is not a token id (not an integer in
            [0, 2^31)).
    """
    out = {}
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdecimal() else None
        if token is None or token >= 2**31:
            raise ApiError(400, f"logit_bias keys must be token ids (integers >= 0, as strings), got {key!r}",
                           param="logit_bias")
        out[token] = value
    return out


def template_fields(body: ChatCompletionRequest | TokenizeRequest, documents=None) -> dict:
    """add_generation_prompt, continue_final_message and chat_template_kwargs (a JSON object, with
    vLLM's `documents` under its "documents" key) as GenerateRequest and TokenizeRequest take them.

    Raises:
        ApiError: 400 for add_generation_prompt and continue_final_message both true (transformers
            refuses them together), `documents` beside a different chat_template_kwargs["documents"],
            or kwargs that are not JSON (NaN).
    """
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError(400, "add_generation_prompt and continue_final_message cannot both be true: the last message "
                            "either ends with the assistant's header or is continued", param="add_generation_prompt")
    kwargs = dict(body.chat_template_kwargs or {})
    if documents is not None:
        if "documents" in kwargs and kwargs["documents"] != documents:
            raise ApiError(400, "documents and chat_template_kwargs.documents differ; send one of them",
                           param="documents")
        kwargs["documents"] = documents
    fields = {"continue_final_message": body.continue_final_message}
    if body.add_generation_prompt is not None:
        fields["add_generation_prompt"] = body.add_generation_prompt
    elif body.continue_final_message:
        fields["add_generation_prompt"] = False
    if kwargs:
        try:
            fields["chat_template_kwargs"] = json.dumps(kwargs, allow_nan=False)
        except ValueError as error:
            raise ApiError(400, f"chat_template_kwargs is not JSON: {error}", param="chat_template_kwargs") from None
    return fields


def chat_request(body: ChatCompletionRequest, check=None, plan: ToolPlan | None = None,
                 decoder: DecoderTools | None = None) -> decoder_pb2.GenerateRequest:
    """The chat's Generate request, base model (the caller sets `lora`).

    `check(request)`: called on the request before its images' bytes are copied in (the caps on
    counts and text: a refused request costs no image copy). `plan` (tools.tool_plan): the body's
    tools go to the chat template when `decoder` says it takes them, and "required" or a named
    function constrain the output (SamplingParams.json_schema).

    Raises:
        ApiError: 400 for top_logprobs without logprobs (as OpenAI), the refusals of `_stream_fields`,
            `sampling`, `template_fields`, `tools.constraint` and `structured.check_options`, a tool
            choice beside another output constraint, or a bad image (`chat_messages`); whatever
            `check` raises.
    """
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    _stream_fields(body)
    max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    request = decoder_pb2.GenerateRequest(
        sampling=sampling(body, max_tokens, body.logprobs, body.top_logprobs or 0, body.prompt_logprobs),
        return_prompt=_continuous_usage(body), **template_fields(body, body.documents))
    if plan is not None:
        if decoder is not None and decoder.takes_tools:
            request.tools = tools_text(body)
        schema = constraint(body, plan)
        if schema is not None:
            if request.sampling.WhichOneof("constraint") is not None:
                other = structured.output_constraint(body).field
                raise ApiError(400, f"tool_choice {plan.mode!r} constrains the output to tool calls; it cannot be "
                                    f"combined with another output constraint ({other})", param="tool_choice")
            request.sampling.json_schema = schema
    structured.check_options(body, request.sampling)
    images: list = []
    chat_messages(body.messages, request.messages, images)
    if check is not None:
        try:
            check(request)
        except TesseraError as error:
            raise from_error(error, chat_fields(body)) from None
    fill_images(images)
    return request


def _continuous_usage(body: SamplingFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.continuous_usage_stats)


def _echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when it is the assistant's (text parts joined
    by newlines, as vLLM), else nothing."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text for p in last.content if isinstance(p, TextPart))


def _shape(body: SamplingFields, chat: bool, model: str, as_ids: bool, **fields) -> Shape:
    prefix = "chatcmpl" if chat else "cmpl"
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return Shape(chat=chat, model=model, ident=f"{prefix}-{body.request_id or uuid.uuid4().hex}",
                 as_ids=as_ids if body.return_tokens_as_token_ids is None else body.return_tokens_as_token_ids,
                 prompt_logprobs=body.prompt_logprobs is not None, include_usage=include_usage,
                 continuous_usage=_continuous_usage(body), **fields)


def chat_shape(body: ChatCompletionRequest, model: str, as_ids: bool, plan: ToolPlan | None = None) -> Shape:
    """How the chat's answer is shaped; `model` names it, `as_ids`: the gateway's
    --return-tokens-as-token-ids (the body's return_tokens_as_token_ids decides when sent);
    `plan`: how tool calls are read from each choice (tools.py)."""
    return _shape(body, True, model, as_ids, logprobs=body.logprobs, echo_text=_echo_text(body), tools=plan)


def completion_shape(body: CompletionRequest, model: str, as_ids: bool) -> Shape:
    """As chat_shape, for completions (echo: the prompt first; max_tokens 0: the prompt alone)."""
    return _shape(body, False, model, as_ids, logprobs=body.logprobs is not None, echo_prompt=body.echo,
                  drop_generated=body.echo and body.max_tokens == 0)


# A refusal that names a protobuf field (TesseraError.field) names the body's field instead
# (errors.body_field): each route's protobuf paths -> the body's names, "" dropping a submessage.
_GENERATE_FIELDS = {"sampling": "", "lora": "model", "prompt_token_ids": "prompt", "prompt": "prompt"}


def chat_fields(body: ChatCompletionRequest) -> dict[str, str]:
    """The chat body's names for Generate's fields (max_tokens as the body sent it; the constraint
    as the field that stated it, structured.constraint_fields; the JSON schema of tool_choice
    "required" or a named function is the tools' parameters, tools.schema_field)."""
    sent = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    fields = {**_GENERATE_FIELDS, "sampling.max_tokens": sent, **structured.constraint_fields(body)}
    schema = schema_field(body)
    if schema is not None:
        fields["sampling.json_schema"] = schema
    return fields


def completion_fields(body: CompletionRequest) -> dict[str, str]:
    """The completions body's names for Generate's fields: top_logprobs is `logprobs`, and so is
    prompt_logprobs when echo asked for it through `logprobs`; a prompt's parts are the prompt; the
    constraint is the field that stated it (structured.constraint_fields)."""
    fields = {**_GENERATE_FIELDS, "sampling.top_logprobs": "logprobs", "prompt.0": "prompt",
              **structured.constraint_fields(body)}
    if body.prompt_logprobs is None:
        fields["sampling.prompt_logprobs"] = "logprobs"
    return fields


MAX_PROMPTS = 64  # prompts in one completions call, each one Generate (a batch past this: several calls)


def completion_requests(body: CompletionRequest) -> list[decoder_pb2.GenerateRequest]:
    """One GenerateRequest (base model) per prompt (a list of texts or of id lists is a batch, as in OpenAI).

    With echo, each asks for the prompt back (return_prompt) and, with logprobs, its tokens'
    logprobs (prompt_logprobs = logprobs, as vLLM); `max_tokens: 0` with echo asks for one token,
    which the answer leaves out (as vLLM).

    Raises:
        ApiError: 400 for max_tokens 0 without echo, an empty prompt list (or token id list in one),
            more than MAX_PROMPTS prompts, or the refusals of `_stream_fields`, `sampling` and
            `structured.check_options`.
    """
    _stream_fields(body)
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens 0 asks for nothing: it is only taken with echo (the prompt alone, with "
                            "its logprobs)", param="max_tokens")
    prompt = body.prompt
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt is an empty list", param="prompt")
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else max(body.max_tokens, 1)
    logprobs = body.logprobs is not None
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo and logprobs:
        prompt_logprobs = body.logprobs
    params = sampling(body, max_tokens, logprobs, body.logprobs or 0, prompt_logprobs)
    structured.check_options(body, params)
    common = {"sampling": params, "return_prompt": body.echo or _continuous_usage(body)}
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt[0], int):
        return [decoder_pb2.GenerateRequest(prompt_token_ids=prompt, **common)]
    else:
        prompts = prompt
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt holds {len(prompts)} prompts; the limit is {MAX_PROMPTS} per request",
                       param="prompt")
    out = []
    for index, item in enumerate(prompts):
        if not item and isinstance(item, list):
            raise ApiError(400, f"prompt.{index} is an empty list of token ids; a prompt needs at least one",
                           param=f"prompt.{index}")
        if isinstance(item, str):
            out.append(decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text=item)], **common))
        else:
            out.append(decoder_pb2.GenerateRequest(prompt_token_ids=item, **common))
    return out


DISCONNECT_POLL_S = 0.5  # how often a whole (non-streamed) answer checks that its client is still there


async def answer_model(backend: Backend, model: str, lora: str) -> str:
    """The `model` an answer names: the adapter, or the base model's first served name (for any alias)."""
    return lora or await backend.base_model()


async def answer(backend: Backend, requests, body: SamplingFields, http: Request, shape: generate.Shape):
    """Open every prompt's Generate (so a refusal answers with its status), then answer whole or as SSE.

    A whole answer whose client goes away is cancelled (its KV blocks and leases come back), as a
    stream is when its response ends early."""
    try:
        streams = await _open(backend, requests, http)
    except TesseraError as error:
        fields = chat_fields(body) if shape.chat else completion_fields(body)
        raise _as_model_error(error, body.model, requests[0].lora, fields) from error
    if body.stream:
        return StreamingResponse(generate.events(streams, body.n, shape), media_type="text/event-stream")
    collecting = asyncio.ensure_future(generate.collect(streams, body.n, shape))
    while not collecting.done():
        await asyncio.wait([collecting], timeout=DISCONNECT_POLL_S)
        if not collecting.done() and await http.is_disconnected():
            collecting.cancel()  # collect's finally cancels every prompt's call
            raise ApiError(499, "the client closed the connection", "cancelled")
    tally = collecting.result()
    return (generate.chat_completion if shape.chat else generate.completion)(tally)


def _as_model_error(error: TesseraError, model: str, lora: str, fields: dict[str, str]) -> ApiError:
    """A refusal of Generate in the HTTP API's terms: the body's field it names (`fields`: `lora` is
    the body's `model`), and an unknown adapter (its reason) as an unknown `model`."""
    refusal = from_error(error, fields)
    details = refusal.message
    if lora and error.reason == UNKNOWN_ADAPTER:
        return ApiError(404, f"model {model!r} is neither the decoder's model nor a loaded adapter ({details})",
                        "not_found_error", param="model")
    return refusal  # a refusal of `lora` names `model` by `fields`


async def _open(backend: Backend, requests, http: Request) -> list[generate.Stream]:
    """Every prompt's Generate started at once, each waited for until its first message.

    All prompts are queued together (one after another, prompt k would not reach the decoder
    before prompt k - 1 had its first token), and a client that leaves while they wait cancels
    every one, as it does once they stream.

    Raises:
        TesseraError: the first prompt (in order) that was refused; the others are cancelled.
        ApiError: 499 when the client closed the connection first.
    """
    for request in requests:
        backend.check_size(request)
    opening = [asyncio.ensure_future(generate.Stream.open(backend.core, request)) for request in requests]
    try:
        while True:
            _, pending = await asyncio.wait(opening, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_EXCEPTION)
            for task in opening:
                if task.done() and task.exception() is not None:
                    raise task.exception()
            if not pending:
                return [task.result() for task in opening]
            if await http.is_disconnected():
                raise ApiError(499, "the client closed the connection", "cancelled")
    except BaseException:
        for task in opening:
            task.cancel()  # a call still waiting for its first message cancels itself (Stream.open)
        await generate.close([task.result() for task in opening
                              if task.done() and not task.cancelled() and task.exception() is None])
        raise
