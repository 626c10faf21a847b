"""Tool calls parsed out of a choice's text, piece by piece as the decoder streams it.

A parser is fed the choice's text in the pieces it arrives in and answers events: `Content` (text
of the answer's `content`), `CallName` (a call starts: its index among the choice's calls and the
function's name) and `CallArguments` (more of that call's arguments, JSON text). The events do
not depend on how the text was cut: feeding it whole (`parse`, the non-streamed answer) or in
any pieces gives the same content and calls, so the SDK's assembly of a stream equals the whole
answer. Three formats, as vLLM's OpenAI server parses them:

- `HermesParser` (tool_choice "auto", vLLM's hermes_tool_parser): the model writes each call as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3, SmolLM3);
  a block is one call once its closing tag is in (or the text ends); a block whose JSON is not an
  object with a string `name` and an object `arguments` stays in the content as written. Text
  outside the blocks is content, except whitespace alone between a call and its neighbours
  (the newlines the format puts between blocks). Arguments are `json.dumps(arguments,
  ensure_ascii=False)`, as vLLM's.
- `RequiredParser` (tool_choice "required"): the text is a JSON array of `{"name", "parameters"}`
  objects (the constraint's schema, vLLM's `_get_json_schema_from_tool`); each complete element
  is a call with arguments `json.dumps(parameters, ensure_ascii=False)`; what does not parse so
  (a cut answer) is content, at the end.
- `NamedParser` (a named tool_choice): the whole text is the one call's arguments, streamed as
  it comes (vLLM's).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallName:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallName | CallArguments


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""


@dataclass
class Parsed:
    """A choice's content (None: no text outside its calls) and calls, events folded."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallParser(ABC):
    """Turns a choice's text, fed in pieces, into content and call events (the module's docstring)."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Events for `text`, the next piece of the choice's text (text that may still turn out to
        be part of a call is held back)."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """Events for whatever is held back, once the choice's text has ended."""


def fold(events: list[Event]) -> Parsed:
    """The content and calls `events` amount to (content None when no Content carried text)."""
    texts, calls = [], {}
    for event in events:
        if isinstance(event, Content):
            texts.append(event.text)
        elif isinstance(event, CallName):
            calls[event.index] = ParsedCall(event.name)
        else:
            calls[event.index].arguments += event.text
    content = "".join(texts)
    return Parsed(content or None, [calls[i] for i in sorted(calls)])


def parse(parser: ToolCallParser, text: str) -> Parsed:
    """`text` parsed whole by `parser` (a fresh one)."""
    return fold(parser.feed(text) + parser.finish())


def _held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may be the tag, cut)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class HermesParser(ToolCallParser):
    """`<tool_call>{json}</tool_call>` blocks (the module's docstring)."""

    def __init__(self) -> None:
        self.buffer = ""            # text not settled yet
        self.inside = False         # the buffer is the body of an open block
        self.num_calls = 0
        self.after_call = False     # the current stretch of content follows a call
        self.has_text = False       # ... and has had text other than whitespace
        self.held_space = ""        # its whitespace so far, while it has no other text

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            if self.inside:
                end = self.buffer.find(HERMES_END)
                if end < 0:
                    return events
                body, self.buffer, self.inside = self.buffer[:end], self.buffer[end + len(HERMES_END):], False
                events += self._block(body, closed=True)
                continue
            start = self.buffer.find(HERMES_START)
            if start < 0:
                keep = _held_prefix(self.buffer, HERMES_START)
                settled, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return events + self._content(settled)
            before, self.buffer, self.inside = self.buffer[:start], self.buffer[start + len(HERMES_START):], True
            events += self._content(before)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.inside:
            body, self.buffer, self.inside = self.buffer, "", False
            events += self._block(body, closed=False)  # an unclosed last block (vLLM parses it too)
        events += self._content(self.buffer)
        self.buffer = ""
        if self.held_space and not self.after_call:  # whitespace alone, touching no call
            events.append(Content(self.held_space))
        self.held_space = ""
        return events

    def _content(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.has_text:
            return [Content(text)]
        self.held_space += text
        if self.held_space.strip():
            out, self.held_space, self.has_text = self.held_space, "", True
            return [Content(out)]
        return []

    def _block(self, body: str, closed: bool) -> list[Event]:
        call = _hermes_call(body)
        if call is None:  # not a call: the block's text is content, as written
            return self._content(HERMES_START + body + (HERMES_END if closed else ""))
        index, self.num_calls = self.num_calls, self.num_calls + 1
        self.after_call, self.has_text, self.held_space = True, False, ""
        return [CallName(index, call.name), CallArguments(index, call.arguments)]


def _hermes_call(body: str) -> ParsedCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments")
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json_value_end(text: str) -> int | None:
    """The end of the JSON object or array `text` starts with (brackets outside strings), or None
    while it is not complete."""
    depth, in_string, escaped = 0, False, False
    for index, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


class RequiredParser(ToolCallParser):
    """A JSON array of `{"name", "parameters"}` objects (the module's docstring)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "start"  # start -> element <-> separator -> done; broken: the rest is content
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self.state not in ("done", "broken"):
            rest = self.buffer.lstrip()
            if not rest:
                break
            if self.state == "start":
                if rest[0] != "[":
                    self.state = "broken"
                    break
                self.buffer, self.state = rest[1:], "element"
            elif self.state == "separator":
                if rest[0] not in ",]":
                    self.state = "broken"
                    break
                self.buffer, self.state = rest[1:], "element" if rest[0] == "," else "done"
            elif rest[0] == "]" and self.num_calls == 0:
                self.buffer, self.state = rest[1:], "done"
            else:
                end = _json_value_end(rest) if rest[0] == "{" else 0
                if end is None:
                    break
                call = _required_call(rest[:end]) if end else None
                if call is None:
                    self.state = "broken"
                    break
                self.buffer, self.state = rest[end:], "separator"
                events += [CallName(self.num_calls, call.name), CallArguments(self.num_calls, call.arguments)]
                self.num_calls += 1
        return events

    def finish(self) -> list[Event]:
        rest, self.buffer = self.buffer, ""
        if self.state == "done" and not rest.strip():
            return []
        return [Content(rest)] if rest else []


def _required_call(text: str) -> ParsedCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    parameters = value.get("parameters")
    if not isinstance(parameters, dict):
        return None
    return ParsedCall(value["name"], json.dumps(parameters, ensure_ascii=False))


class NamedParser(ToolCallParser):
    """The whole text is one call of `name`: its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def _start(self) -> list[Event]:
        if self.started:
            return []
        self.started = True
        return [CallName(0, self.name)]

    def feed(self, text: str) -> list[Event]:
        return self._start() + ([CallArguments(0, text)] if text else [])

    def finish(self) -> list[Event]:
        return self._start()
