"""JSON bodies parsed off the event loop: the loop that runs the HTTP routes also serves the
gateway's public gRPC port, and json.loads of a 200 MiB chat body holds it for a second.

A route of `OffLoopJsonRoute` reads its (already bounded: body_limit.BodyLimit) body into one
buffer; a body of more than OFF_LOOP_BYTES bytes is decoded and parsed in a worker thread, its
raw bytes released as soon as they are decoded, and FastAPI validates the parsed value as it
would its own. Smaller bodies are left to FastAPI as they are.

A worker thread alone does not free the loop: json.loads parses a whole document in one C call
that holds the GIL (0.8 s for 200 MiB here). So the long plain strings a large body carries (its
base64 data URIs) are cut out first and decoded in slices of SLICE_BYTES, the short rest is parsed
with each one's place taken by a placeholder no client can write (a fresh random nonce), and the
strings are put back; the value is the one json.loads gives the whole body (`parse` falls back to
it wherever the cut is not certain to be exact).
"""

from __future__ import annotations

import asyncio
import email.message
import json
import secrets

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

OFF_LOOP_BYTES = 1 << 20  # bodies up to this many bytes parse on the loop (about a millisecond)


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this Content-Type as JSON (absent: it does)."""
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


LONG_STRING_BYTES = 1 << 16  # strings at least this long are cut out before json.loads
SLICE_BYTES = 4 << 20  # the most one C call scans or copies while the GIL is held (milliseconds)
_PLAIN = bytes(b for b in range(0x20, 0x7F) if b != 0x5C)  # what a plain string's bytes may be


MAX_QUOTES = 1 << 16  # a body with more quotes (or longer backslash runs) is parsed by json.loads alone
_MAX_BACKSLASHES = 64


def _escaped(buffer: bytearray, quote: int) -> bool | None:
    """Whether the quote at `quote` is escaped: preceded by an odd run of backslashes; None past
    _MAX_BACKSLASHES of them."""
    i = quote
    while i > 0 and buffer[i - 1] == 0x5C:
        i -= 1
        if quote - i > _MAX_BACKSLASHES:
            return None
    return (quote - i) % 2 == 1


def _long_strings(buffer: bytearray) -> list[tuple[int, int]]:
    """(start, end) of the content of each string token of `buffer` that is at least
    LONG_STRING_BYTES long and plain: printable ASCII without a backslash, so its text is its bytes.

    Tokens are found by the quotes that are not escaped, which open and close strings in turn in
    any valid JSON (memchr's speed: a long string holds no quote); the caller checks the result
    against json.loads (see `parse`). Empty past MAX_QUOTES quotes: a scan in Python would be
    slower than json.loads."""
    spans, inside, opened, pos = [], False, 0, 0
    for _ in range(MAX_QUOTES):
        if (quote := buffer.find(b'"', pos)) < 0:
            return spans
        pos = quote + 1
        if not inside:
            inside, opened = True, pos
            continue
        escaped = _escaped(buffer, quote)
        if escaped is None:
            return []
        if not escaped:
            inside = False
            if quote - opened >= LONG_STRING_BYTES and _plain(buffer, opened, quote):
                spans.append((opened, quote))
    return []


def _plain(buffer: bytearray, start: int, end: int) -> bool:
    """Whether buffer[start:end] holds only _PLAIN bytes, checked a slice at a time."""
    return not any(buffer[i:min(i + SLICE_BYTES, end)].translate(None, _PLAIN)
                   for i in range(start, end, SLICE_BYTES))


def _text(buffer: bytearray, start: int, end: int) -> str:
    """buffer[start:end] (ASCII) as a str, decoded a slice at a time."""
    return "".join(buffer[i:min(i + SLICE_BYTES, end)].decode("ascii") for i in range(start, end, SLICE_BYTES))


def parse(buffer: bytearray):
    """The JSON value in `buffer` (UTF-8), which is emptied once decoded: json.loads of its text,
    without holding the GIL for more than a slice's work at a time on its long plain strings.

    Raises:
        UnicodeDecodeError, json.JSONDecodeError, RecursionError: as json.loads(buffer.decode()) would.
    """
    spans = _long_strings(buffer)
    if spans:
        nonce = secrets.token_hex(16)
        strings, short, last = {}, bytearray(), 0
        for i, (start, end) in enumerate(spans):
            placeholder = f"tessera:{nonce}:{i}"
            strings[placeholder] = _text(buffer, start, end)
            short += buffer[last:start]
            short += placeholder.encode()
            last = end
        short += buffer[last:]
        try:
            value, restored = _restore(json.loads(short.decode("utf-8")), strings)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            restored = -1  # json.loads of the whole body gives its own error, at its own position
        if restored == len(strings):  # every placeholder was a whole string value: exact
            buffer.clear()
            return value
    text = buffer.decode("utf-8")
    buffer.clear()  # the raw bytes go before the parse makes its objects
    return json.loads(text)


def _restore(value, strings: dict[str, str]):
    """(`value` with each placeholder string value put back, how many were put back); a
    placeholder left in a key or inside a longer string is not counted. Iterative: json.loads
    nests deeper than Python's recursion limit allows a walk to."""
    count = 0

    def put_back(node):
        nonlocal count
        if isinstance(node, str) and (original := strings.get(node)) is not None:
            count += 1
            return original
        return node

    pending = [value]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            for i, item in enumerate(node):
                node[i] = put_back(item)
            pending.extend(item for item in node if isinstance(item, list | dict))
        elif isinstance(node, dict):
            for key, item in node.items():
                node[key] = put_back(item)
            pending.extend(item for item in node.values() if isinstance(item, list | dict))
    return put_back(value), count


class _ReadRequest(Request):
    """A request whose body has been read: `body()` answers its bytes, and `json()` its parsed value
    where that was parsed off the loop (then the raw bytes are gone and body() answers a stand-in:
    FastAPI asks it only to learn that there is a body)."""

    _UNPARSED = object()

    def __init__(self, scope, receive, body: bytes, value=_UNPARSED) -> None:
        super().__init__(scope, receive)
        self._read, self._value = body, value

    async def body(self) -> bytes:
        return self._read

    async def json(self):
        return await super().json() if self._value is self._UNPARSED else self._value


class OffLoopJsonRoute(APIRoute):
    """An APIRoute whose JSON bodies past OFF_LOOP_BYTES are parsed in a worker thread (see the
    module's docstring); the answer to a body that is not JSON is FastAPI's own (400 here)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            if request.method not in ("POST", "PUT", "PATCH") or not _is_json(request.headers.get("content-type")):
                return await handler(request)
            buffer = bytearray()
            async for chunk in request.stream():
                buffer += chunk
            if len(buffer) <= OFF_LOOP_BYTES:
                return await handler(_ReadRequest(request.scope, request.receive, bytes(buffer)))
            try:
                value = await asyncio.to_thread(parse, buffer)
            except json.JSONDecodeError as error:  # as FastAPI answers it, without echoing the body
                raise RequestValidationError([{"type": "json_invalid", "loc": ("body", error.pos),
                                               "msg": "JSON decode error", "input": {},
                                               "ctx": {"error": error.msg}}]) from None
            except (UnicodeDecodeError, RecursionError) as error:  # FastAPI's answer to a body it cannot parse
                raise HTTPException(status_code=400, detail="There was an error parsing the body") from error
            finally:
                del buffer
            return await handler(_ReadRequest(request.scope, request.receive, b"{}", value))

        return route
