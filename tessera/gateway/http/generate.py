"""Chat and text completions over the gateway's Generate stream, whole or as server-sent events.

A stream's first message is awaited before the HTTP response starts, so a refusal (bad input,
unknown adapter, a service down) still answers with its own status and OpenAI's error object; a
failure after that ends the event stream with one `data: {"error": ...}` event (as vLLM does).
Streams end with `data: [DONE]`; with `stream_options.include_usage` the event before it carries
`usage` and no choices (OpenAI's convention).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from tessera.gateway.http import convert, models
from tessera.gateway.http.errors import from_rpc_error
from tessera.v1 import decoder_pb2


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Tally:
    """Choices and token counts over the Generate streams of one HTTP request (one per prompt)."""

    n: int
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # per prompt
    completion_tokens: int = 0

    def index(self, prompt: int, response: decoder_pb2.GenerateResponse) -> int:
        return prompt * self.n + response.index

    def add(self, prompt: int, response: decoder_pb2.GenerateResponse) -> None:
        choice = self.choices.setdefault(self.index(prompt, response), _Choice())
        choice.text.append(response.text)
        choice.logprobs.extend(response.logprobs)
        if response.finish_reason:
            choice.finish_reason = response.finish_reason
        if response.HasField("usage"):  # each choice's final message
            self.prompt_tokens[prompt] = response.usage.prompt_tokens
            self.completion_tokens += response.usage.completion_tokens

    def usage(self) -> models.Usage:
        prompt = sum(self.prompt_tokens.values())
        return models.Usage(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                            total_tokens=prompt + self.completion_tokens)


class Stream:
    """One Generate call whose first message has arrived (or that ended without any)."""

    def __init__(self, call, first: decoder_pb2.GenerateResponse | None):
        self.call, self.first = call, first

    @classmethod
    async def open(cls, stub, request: decoder_pb2.GenerateRequest, metadata) -> Stream:
        """Start Generate and wait for its first message; raises AioRpcError for a refusal."""
        call = stub.Generate(request, metadata=metadata)
        try:
            first = await call.read()
        except BaseException:
            call.cancel()
            raise
        return cls(call, None if first is grpc.aio.EOF else first)

    async def messages(self) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        try:
            if self.first is None:
                return
            yield self.first
            while (message := await self.call.read()) is not grpc.aio.EOF:
                yield message
        finally:
            self.call.cancel()  # the HTTP client went away: the decoder frees the request's blocks


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def cancel(streams: list[Stream]) -> None:
    """End every call (a failure or a departed client must not leave later prompts generating)."""
    for stream in streams:
        stream.call.cancel()


async def collect(streams: list[Stream], n: int) -> Tally:
    tally = Tally(n)
    try:
        for prompt, stream in enumerate(streams):
            async for message in stream.messages():
                tally.add(prompt, message)
    finally:
        cancel(streams)
    return tally


def chat_completion(tally: Tally, model: str, logprobs: bool) -> models.ChatCompletion:
    choices = [models.ChatChoice(index=i, message=models.AssistantMessage(content="".join(c.text)),
                                 finish_reason=c.finish_reason,
                                 logprobs=convert.chat_logprobs(c.logprobs) if logprobs else None)
               for i, c in sorted(tally.choices.items())]
    return models.ChatCompletion(id=_id("chatcmpl"), created=int(time.time()), model=model, choices=choices,
                                 usage=tally.usage())


def completion(tally: Tally, model: str, logprobs: bool) -> models.Completion:
    choices = [models.CompletionChoice(index=i, text="".join(c.text), finish_reason=c.finish_reason,
                                       logprobs=convert.completion_logprobs(c.logprobs) if logprobs else None)
               for i, c in sorted(tally.choices.items())]
    return models.Completion(id=_id("cmpl"), created=int(time.time()), model=model, choices=choices,
                             usage=tally.usage())


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def events(streams: list[Stream], n: int, model: str, chat: bool, logprobs: bool,
                 include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events of chat.completion.chunk (or text_completion) objects, then [DONE]."""
    tally = Tally(n)
    ident, created = _id("chatcmpl" if chat else "cmpl"), int(time.time())
    head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model}
    started: set[int] = set()
    try:
        for prompt, stream in enumerate(streams):
            async for message in stream.messages():
                tally.add(prompt, message)
                index = tally.index(prompt, message)
                choice: dict = {"index": index, "finish_reason": message.finish_reason or None}
                if chat:
                    choice["delta"] = {"content": message.text}
                    if index not in started:
                        choice["delta"]["role"] = "assistant"
                    choice["logprobs"] = (convert.chat_logprobs(message.logprobs).model_dump()
                                          if logprobs else None)
                else:
                    choice["text"] = message.text
                    choice["logprobs"] = (convert.completion_logprobs(message.logprobs).model_dump()
                                          if logprobs else None)
                started.add(index)
                yield _event({**head, "choices": [choice]})
    except grpc.aio.AioRpcError as error:
        failure = from_rpc_error(error)
        yield _event({"error": {"message": failure.message, "type": failure.type, "param": None,
                                "code": failure.status}})
    else:
        if include_usage:
            yield _event({**head, "choices": [], "usage": tally.usage().model_dump()})
    finally:
        cancel(streams)
    yield "data: [DONE]\n\n"
