"""Request bodies bounded before they are parsed: per-route byte limits, a bound on JSON values,
a budget of body bytes in flight over all requests, and timeouts for a body that stalls or drips.
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
RETRY_AFTER_S = 1  # what a request refused for the in-flight budget is told to wait (Retry-After, seconds)
IMAGE_ROUTES = frozenset({"/v1/chat/completions"})  # bodies that may carry base64 images

# JSON values in one body, counted as its commas (every array element or object member after the
# first follows one): 64 prompts of 16384 token ids. A body is parsed whole into Python objects,
# ~40-130 bytes each, before any field is validated: without this bound a 50 MB list of small ints
# took 6.6 GB of the gateway's memory (4 M ids, 8 MiB, still took 1.2 GB and 4 s of its loop).
# Commas inside strings count too, which only makes it stricter.
MAX_JSON_VALUES = 64 * 16384


class BodyBudget:
    """Bytes of request bodies in flight over all requests, at most `max_bytes` (0: no budget).

    A request holds its share from before its body is read until its answer is complete (its
    parsed body and the messages built from it live that long)."""

    def __init__(self, max_bytes: int = 0) -> None:
        self.max_bytes, self.held = max_bytes, 0

    def take(self, num_bytes: int) -> bool:
        """Holds `num_bytes` more if they fit; False (nothing held) if not."""
        if self.max_bytes and self.held + num_bytes > self.max_bytes:
            return False
        self.held += num_bytes
        return True

    def give(self, num_bytes: int) -> None:
        self.held -= num_bytes

    def refusal(self, num_bytes: int, path: str) -> ApiError:
        return ApiError(503, f"the gateway holds {self.held} bytes of request bodies in flight; {num_bytes} more for "
                             f"{path} would pass the budget of {self.max_bytes} (--max-body-bytes-in-flight): retry "
                             f"in {RETRY_AFTER_S} s", "server_error", headers={"Retry-After": str(RETRY_AFTER_S)})


class BodyLimit:
    """Refuses with 413 a body past its route's byte limit (`max_bytes` where images may come, else
    `max_text_bytes`) or holding more than MAX_JSON_VALUES values: from its Content-Length before
    reading it, else as soon as the bytes read pass a limit; with 503 and Retry-After a body that
    would pass `budget` (BodyBudget: its Content-Length before reading it, else as its bytes come);
    with 408 a body whose next piece has not come for `read_timeout_s`, or that is not in after
    `total_timeout_s` (a client that announces a body and stalls, or drips it)."""

    def __init__(self, app, max_bytes: int, max_text_bytes: int, read_timeout_s: float = BODY_READ_TIMEOUT_S,
                 total_timeout_s: float = BODY_TOTAL_TIMEOUT_S, budget: BodyBudget | None = None):
        self.app, self.max_bytes, self.max_text_bytes = app, max_bytes, min(max_bytes, max_text_bytes)
        self.read_timeout_s, self.total_timeout_s = read_timeout_s, total_timeout_s
        self.budget = budget or BodyBudget()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes if scope.get("path") in IMAGE_ROUTES else self.max_text_bytes
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            refusal = ApiError(413, f"the request body has {int(length)} bytes; the limit is {limit} for "
                                    f"{scope.get('path')}")
            return await refusal.response(tei_shaped(scope))(scope, receive, send)
        held = int(length) if length.isdigit() else 0
        if not self.budget.take(held):
            refusal = self.budget.refusal(held, scope.get("path"))
            return await refusal.response(tei_shaped(scope))(scope, receive, send)
        try:
            await self._limited(scope, receive, send, limit, held)
        finally:
            self.budget.give(held)

    async def _limited(self, scope, receive, send, limit: int, announced: int) -> None:
        """The app with `receive` counting the body; a body past `announced` bytes (chunked, or past
        its Content-Length) takes its further bytes from the budget as they come, and gives them
        back when the answer is complete."""
        extra = 0
        seen = values = 0
        reading = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout_s

        async def counted():
            nonlocal seen, values, reading, extra
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
            if seen > announced + extra:
                more = seen - announced - extra
                if not self.budget.take(more):
                    raise self.budget.refusal(more, scope.get("path"))
                extra += more
            if values > MAX_JSON_VALUES:
                raise ApiError(413, f"the request body holds more than {MAX_JSON_VALUES} JSON values (counted as "
                                    f"commas); the limit is {MAX_JSON_VALUES}")
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            self.budget.give(extra)
