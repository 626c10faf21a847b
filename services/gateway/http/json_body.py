"""JSON bodies parsed off the event loop: the loop that runs the HTTP routes also serves the
gateway's public gRPC port, and json.loads of a 200 MiB chat body holds it for a second.

A route of `OffLoopJsonRoute` reads its (already bounded: body_limit.BodyLimit) body into one
buffer; a body of more than OFF_LOOP_BYTES bytes is decoded and parsed in a worker thread, its
raw bytes released as soon as they are decoded, and FastAPI validates the parsed value as it
would its own. Smaller bodies are left to FastAPI as they are.
"""

from __future__ import annotations

import asyncio
import email.message
import json

from fastapi import Request
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


def _parse(buffer: bytearray):
    """The JSON value in `buffer` (UTF-8), which is emptied once decoded. Raises UnicodeDecodeError
    or json.JSONDecodeError."""
    text = buffer.decode("utf-8")
    buffer.clear()  # the raw bytes go before the parse makes its objects
    return json.loads(text)


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
                value = await asyncio.to_thread(_parse, buffer)
            except json.JSONDecodeError as error:  # as FastAPI answers it, without echoing the body
                raise RequestValidationError([{"type": "json_invalid", "loc": ("body", error.pos),
                                               "msg": "JSON decode error", "input": {},
                                               "ctx": {"error": error.msg}}]) from None
            finally:
                del buffer
            return await handler(_ReadRequest(request.scope, request.receive, b"{}", value))

        return route
