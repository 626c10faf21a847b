"""Request bodies bounded before they are parsed: per-route byte limits, a bound on JSON values,
and timeouts for a body that stalls or drips.
"""

from __future__ import annotations

import asyncio

from services.common.message_limits import FRAMING_BYTES, TEXT_BYTES
from services.gateway.http.errors import ApiError, tei_shaped

# text-only routes: one Generate's text (message_limits.TEXT_BYTES) and its framing, twice over for
# JSON's escapes (a non-ASCII character is up to 6 bytes as \uXXXX, at most 4 in UTF-8)
TEXT_BODY_BYTES = 2 * (TEXT_BYTES + FRAMING_BYTES)
BODY_READ_TIMEOUT_S = 30.0  # the longest wait for the next piece of a body (a stalled client holds a connection)
BODY_TOTAL_TIMEOUT_S = 300.0  # and for the whole body (a client dripping a byte a piece holds one too)
IMAGE_ROUTES = frozenset({"/v1/chat/completions"})  # bodies that may carry base64 images

# JSON values in one body, counted as its commas (every array element or object member after the
# first follows one): 64 prompts of 16384 token ids. A body is parsed whole into Python objects,
# ~40-130 bytes each, before any field is validated: without this bound a 50 MB list of small ints
# took 6.6 GB of the gateway's memory (4 M ids, 8 MiB, still took 1.2 GB and 4 s of its loop).
# Commas inside strings count too, which only makes it stricter.
MAX_JSON_VALUES = 64 * 16384


class BodyLimit:
    """Refuses with 413 a body past its route's byte limit (`max_bytes` where images may come, else
    `max_text_bytes`) or holding more than MAX_JSON_VALUES values: from its Content-Length before
    reading it, else as soon as the bytes read pass a limit; with 408 a body whose next piece has
    not come for `read_timeout_s`, or that is not in after `total_timeout_s` (a client that announces
    a body and stalls, or drips it)."""

    def __init__(self, app, max_bytes: int, max_text_bytes: int, read_timeout_s: float = BODY_READ_TIMEOUT_S,
                 total_timeout_s: float = BODY_TOTAL_TIMEOUT_S):
        self.app, self.max_bytes, self.max_text_bytes = app, max_bytes, min(max_bytes, max_text_bytes)
        self.read_timeout_s, self.total_timeout_s = read_timeout_s, total_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes if scope.get("path") in IMAGE_ROUTES else self.max_text_bytes
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            refusal = ApiError(413, f"the request body has {int(length)} bytes; the limit is {limit} for "
                                    f"{scope.get('path')}")
            return await refusal.response(tei_shaped(scope))(scope, receive, send)
        seen = values = 0
        reading = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout_s

        async def counted():
            nonlocal seen, values, reading
            if not reading:  # the body is in: from here on only a disconnect comes, whenever it does
                return await receive()
            try:
                async with asyncio.timeout_at(min(loop.time() + self.read_timeout_s, deadline)):
                    message = await receive()
            except TimeoutError:
                why = (f"it took longer than {self.total_timeout_s:g} s" if loop.time() >= deadline
                       else f"no bytes for {self.read_timeout_s:g} s")
                raise ApiError(408, f"the request body stalled: {why} after {seen} bytes") from None
            reading = message.get("type") == "http.request" and message.get("more_body", False)
            chunk = message.get("body", b"")
            seen += len(chunk)
            values += chunk.count(b",")
            if seen > limit:
                raise ApiError(413, f"the request body passed {limit} bytes, the limit for {scope.get('path')}")
            if values > MAX_JSON_VALUES:
                raise ApiError(413, f"the request body holds more than {MAX_JSON_VALUES} JSON values (counted as "
                                    f"commas); the limit is {MAX_JSON_VALUES}")
            return message

        await self.app(scope, counted, send)
