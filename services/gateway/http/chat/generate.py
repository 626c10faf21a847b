"""Chat and text completions over the core's Generate responses, whole or as server-sent events.

A stream's first message is awaited before the HTTP response starts, so a refusal (bad input,
unknown adapter, a service down) still answers with its own status and OpenAI's error object; a
failure after that ends the event stream with one `data: {"error": ...}` event (as vLLM does).

Events follow OpenAI's stream exactly: per choice a first chat event with `delta: {"role":
"assistant", "content": ""}` (with chat's echo, then one with the echoed text and no logprobs, as
vLLM's), then one event per decoder message with its text (and logprobs),
then an event with an empty delta (completions: text "") and the finish_reason, so content and
finish_reason never share an event; with `stream_options.include_usage` every event carries
`"usage": null` and a last one carries the usage with `"choices": []`; `data: [DONE]` ends the stream.

With tool calls read (tool_choice other than "none", chat/tools.py), each choice's text goes
through its own parser (tool_parsers.py): the first event's content is null, content events carry
the text the parser lets through, and each call is OpenAI's deltas, a first `{index, id, type,
function: {name, arguments: ""}}` then its arguments; the whole answer's `message.tool_calls` are
the same calls, and a choice that made calls and stopped ends with finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from services.common.errors import TesseraError
from services.gateway.core import Call
from services.gateway.http.chat import logprobs as lp
from services.gateway.http.chat.protocol import (
    AnswerFunction,
    AnswerToolCall,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    PromptLogprobs,
)
from services.gateway.http.chat.tool_parsers import CallName, Content, Event, ToolCallParser
from services.gateway.http.chat.tools import NONE, ToolPlan
from services.gateway.http.errors import from_error
from services.gateway.http.protocol import Usage
from tessera.v1 import decoder_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    """What a route asks of its answer beyond the decoder's messages.

    `echo_prompt`: completions' echo, the prompt's text (and its tokens' logprobs) first;
    `echo_text`: chat's echo (vLLM's), the last assistant message's content first;
    `drop_generated`: `max_tokens: 0` with echo, the one token asked of the decoder is not
    returned nor counted; `prompt_logprobs`: vLLM's prompt_logprobs answer; `as_ids`: logprob
    tokens as `token_id:<id>`; `continuous_usage`: vLLM's usage on every event.
    """

    chat: bool
    model: str
    ident: str
    logprobs: bool = False
    as_ids: bool = False
    echo_prompt: bool = False
    echo_text: str = ""
    drop_generated: bool = False
    prompt_logprobs: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    tools: ToolPlan | None = None

    @property
    def parses_tools(self) -> bool:
        """Whether each choice's text is read for tool calls (tool_choice other than "none")."""
        return self.tools is not None and self.tools.mode != NONE


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


@dataclass
class _Choice:
    parser: ToolCallParser | None = None
    calls: dict[int, _Call] = field(default_factory=dict)  # by the parser's call index
    text: list[str] = field(default_factory=list)
    entries: list = field(default_factory=list)             # chat: the decoder's TokenLogprob entries
    legacy: lp.LegacyLogprobs | None = None             # completions: legacy logprobs
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class _Delta:
    """What one decoder message adds to its choice (a stream event's content): `head`, on a
    choice's first message, the echoed text before the generated `text`."""

    index: int
    first: bool
    head: str
    text: str
    entries: list
    legacy_from: int
    calls: list[Event] = field(default_factory=list)  # tool-call events (CallName, CallArguments), in order


@dataclass
class Tally:
    """Choices and token counts over the Generate streams of one HTTP request (one per prompt)."""

    n: int
    shape: Shape
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # per prompt
    completion_tokens: int = 0

    def add(self, prompt: int, response: decoder_pb2.GenerateResponse) -> _Delta:
        index = prompt * self.n + response.index
        first = index not in self.choices
        choice = self.choices.setdefault(index, _Choice())
        shape, head = self.shape, ""
        if first:
            choice.prompt_tokens = len(response.prompt_token_ids)
            head = response.prompt_text if shape.echo_prompt else shape.echo_text
            if shape.logprobs and not shape.chat:
                choice.legacy = lp.LegacyLogprobs(shape.as_ids)
                if shape.echo_prompt:
                    choice.legacy.add_prompt(response)
            if shape.prompt_logprobs:
                choice.prompt_logprobs = lp.prompt_logprobs(response)
        legacy_from = len(choice.legacy) if choice.legacy is not None and not first else 0
        generated, entries = ("", []) if shape.drop_generated else (response.text, list(response.logprobs))
        calls: list[Event] = []
        if first and shape.parses_tools:
            choice.parser = shape.tools.new_parser()
        if choice.parser is not None:
            generated, calls = self._parse(choice, generated, bool(response.finish_reason))
        choice.text.append(head + generated)
        if shape.logprobs and shape.chat:
            choice.entries.extend(entries)
        elif choice.legacy is not None:
            for entry in entries:
                choice.legacy.add(entry)
        if not shape.drop_generated:
            choice.completion_tokens += len(response.token_ids)
        if response.finish_reason:
            stopped_with_calls = response.finish_reason == "stop" and choice.calls
            choice.finish_reason = "tool_calls" if stopped_with_calls else response.finish_reason
        if response.HasField("usage"):  # each choice's final message
            self.prompt_tokens[prompt] = choice.prompt_tokens = response.usage.prompt_tokens
            counted = 0 if shape.drop_generated else response.usage.completion_tokens
            self.completion_tokens += counted
            choice.completion_tokens = counted
        return _Delta(index, first, head, generated, entries, legacy_from, calls)

    def _parse(self, choice: _Choice, text: str, last: bool) -> tuple[str, list[Event]]:
        """`text` through the choice's tool-call parser (finished on its last message): the content
        it lets through and its call events, past the first call dropped unless parallel calls."""
        events = choice.parser.feed(text) + (choice.parser.finish() if last else [])
        content, calls = [], []
        for event in events:
            if isinstance(event, Content):
                content.append(event.text)
                continue
            if event.index > 0 and not self.shape.tools.parallel:
                continue
            if isinstance(event, CallName):
                choice.calls[event.index] = _Call(f"chatcmpl-tool-{uuid.uuid4().hex}", event.name)
            else:
                choice.calls[event.index].arguments += event.text
            calls.append(event)
        return "".join(content), calls

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens.values())
        return Usage(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                               total_tokens=prompt + self.completion_tokens)


class Stream:
    """One Generate of the core whose first message has arrived (or that ended without any).

    Closing it (`close`, or leaving `messages` early) closes the core's response iterator, which
    cancels the decoder's call: the decoder frees the request's KV blocks and adapter lease.
    """

    def __init__(self, responses: AsyncGenerator[decoder_pb2.GenerateResponse, None],
                 first: decoder_pb2.GenerateResponse | None):
        self.responses, self.first = responses, first

    @classmethod
    async def open(cls, core, request: decoder_pb2.GenerateRequest) -> Stream:
        """Start the core's Generate and wait for its first message; raises TesseraError for a refusal."""
        responses = core.generate(request, Call())
        try:
            first = await anext(responses)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await responses.aclose()
            raise
        return cls(responses, first)

    async def messages(self) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        try:
            if self.first is None:
                return
            yield self.first
            async for message in self.responses:
                yield message
        finally:
            await self.close()  # the HTTP client went away: the decoder frees the request's blocks

    async def close(self) -> None:
        await self.responses.aclose()


async def close(streams: list[Stream]) -> None:
    """End every Generate (a failure or a departed client must not leave later prompts generating)."""
    for stream in streams:
        await stream.close()


async def collect(streams: list[Stream], n: int, shape: Shape) -> Tally:
    tally = Tally(n, shape)
    try:
        for prompt, stream in enumerate(streams):
            async for message in stream.messages():
                tally.add(prompt, message)
    finally:
        await close(streams)
    return tally


def _message(choice: _Choice, shape: Shape) -> AssistantMessage:
    """A choice's message; with tool calls parsed, its calls and content null when it has no text."""
    content = "".join(choice.text)
    if not shape.parses_tools:
        return AssistantMessage(content=content)
    calls = [AnswerToolCall(id=call.id, function=AnswerFunction(name=call.name, arguments=call.arguments))
             for _, call in sorted(choice.calls.items())]
    return AssistantMessage(content=content or None, tool_calls=calls)


def chat_completion(tally: Tally) -> ChatCompletion:
    shape = tally.shape
    choices = [ChatChoice(index=i, message=_message(c, shape), finish_reason=c.finish_reason,
                                    logprobs=lp.chat_logprobs(c.entries, shape.as_ids) if shape.logprobs else None)
               for i, c in sorted(tally.choices.items())]
    first = tally.choices.get(0)
    return ChatCompletion(id=shape.ident, created=int(time.time()), model=shape.model, choices=choices,
                                    usage=tally.usage(), prompt_logprobs=first.prompt_logprobs if first else None)


def completion(tally: Tally) -> Completion:
    shape = tally.shape
    choices = [CompletionChoice(index=i, text="".join(c.text), finish_reason=c.finish_reason,
                                          logprobs=c.legacy.answer if c.legacy is not None else None,
                                          prompt_logprobs=c.prompt_logprobs)
               for i, c in sorted(tally.choices.items())]
    return Completion(id=shape.ident, created=int(time.time()), model=shape.model, choices=choices,
                                usage=tally.usage())


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Events:
    """The event payloads of one streamed answer (OpenAI's chunk objects)."""

    def __init__(self, tally: Tally):
        self.tally, shape = tally, tally.shape
        self.head = {"id": shape.ident, "object": "chat.completion.chunk" if shape.chat else "text_completion",
                     "created": int(time.time()), "model": shape.model}

    def chunk(self, choice: dict, index: int, generated: bool = True) -> str:
        """One event; with continuous usage, its choice's tokens so far (`generated` false: an event
        before the generated text, the role's or the echo's, counts none, as vLLM's)."""
        payload = {**self.head, "choices": [choice]}
        shape = self.tally.shape
        if shape.continuous_usage:
            c = self.tally.choices[index]
            completion = c.completion_tokens if generated else 0
            payload["usage"] = Usage(prompt_tokens=c.prompt_tokens, completion_tokens=completion,
                                               total_tokens=c.prompt_tokens + completion).model_dump()
        elif shape.include_usage:
            payload["usage"] = None
        return _event(payload)

    def of(self, delta: _Delta, finish_reason: str) -> list[str]:
        shape, out = self.tally.shape, []
        choice = self.tally.choices[delta.index]
        if shape.chat:
            if delta.first:  # with tool calls read, content stays null unless text comes (OpenAI's stream)
                role = {"role": "assistant", "content": None if shape.parses_tools else ""}
                out.append(self.chunk({"index": delta.index, "delta": role,
                                       "logprobs": None, "finish_reason": None}, delta.index, generated=False))
            if delta.head:  # the echoed message in an event of its own, without logprobs (as vLLM)
                out.append(self.chunk({"index": delta.index, "delta": {"content": delta.head}, "logprobs": None,
                                       "finish_reason": None}, delta.index, generated=False))
            if delta.text or delta.entries:
                logprobs = lp.chat_logprobs(delta.entries, shape.as_ids).model_dump() if shape.logprobs else None
                content = {"content": delta.text} if delta.text or not shape.parses_tools else {}
                out.append(self.chunk({"index": delta.index, "delta": content, "logprobs": logprobs,
                                       "finish_reason": None}, delta.index))
            out.extend(self._call_chunk(delta.index, event) for event in delta.calls)
            if finish_reason:
                out.append(self.chunk({"index": delta.index, "delta": {}, "logprobs": None,
                                       "finish_reason": choice.finish_reason}, delta.index))
            return out
        shown = choice.legacy is not None and len(choice.legacy) > delta.legacy_from
        text = delta.head + delta.text  # echo: the prompt with its tokens' logprobs, then the generated text
        if text or shown:
            logprobs = choice.legacy.since(delta.legacy_from).model_dump() if choice.legacy is not None else None
            out.append(self.chunk({"index": delta.index, "text": text, "logprobs": logprobs,
                                   "finish_reason": None}, delta.index))
        if finish_reason:
            out.append(self.chunk({"index": delta.index, "text": "", "logprobs": None,
                                   "finish_reason": finish_reason}, delta.index))
        return out


    def _call_chunk(self, index: int, event: Event) -> str:
        """OpenAI's tool-call delta: a call's first (index, id, type, name, arguments "") or more of
        its arguments."""
        call = self.tally.choices[index].calls[event.index]
        if isinstance(event, CallName):
            entry = {"index": event.index, "id": call.id, "type": "function",
                     "function": {"name": event.name, "arguments": ""}}
        else:
            entry = {"index": event.index, "function": {"arguments": event.text}}
        return self.chunk({"index": index, "delta": {"tool_calls": [entry]}, "logprobs": None,
                           "finish_reason": None}, index)


async def events(streams: list[Stream], n: int, shape: Shape) -> AsyncIterator[str]:
    """Server-sent events of chat.completion.chunk (or text_completion) objects, then [DONE]."""
    tally = Tally(n, shape)
    shaper = _Events(tally)
    try:
        for prompt, stream in enumerate(streams):
            async for message in stream.messages():
                for event in shaper.of(tally.add(prompt, message), message.finish_reason):
                    yield event
    except Exception as error:  # the answer has started: the failure becomes its last event
        if not isinstance(error, TesseraError):
            log.exception("a streamed answer failed")
        failure = from_error(error)
        yield _event({"error": {"message": failure.message, "type": failure.type, "param": None,
                                "code": failure.status}})
    else:
        if shape.include_usage:
            yield _event({**shaper.head, "choices": [], "usage": tally.usage().model_dump()})
    finally:
        await close(streams)
    yield "data: [DONE]\n\n"
