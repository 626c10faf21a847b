"""Client request streams that a refusal does not cut short.

A server that ends a client-streaming call while the client is still writing makes grpc's asyncio
client report INTERNAL "Internal error from Core" instead of the server's status: the client's
write fails first, and that failure becomes the call's status (grpc 1.85, grpc/aio/_call.py
`_write` -> `set_internal_error`). The gateway relays EmbedStream to pooling through such a client,
so a pooling refusal of one bad message reached users as INTERNAL about one time in ten.

`RequestPump` reads the client's messages in a task of its own. After a refusal the handler
`drain()`s it: messages still arriving are read and dropped (no work is done on them) until the
client half-closes, cancels, its deadline passes or DRAIN_TIMEOUT_S goes by (a client that waits
for a reply before sending more would otherwise wait forever), and only then does the handler
raise, so the status is the last thing on the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

_END = object()
DRAIN_TIMEOUT_S = 2.0


class RequestPump:
    """Reads `requests` ahead, at most `window` messages buffered; iterate it once with `async for`."""

    def __init__(self, requests: AsyncIterator, window: int = 64) -> None:
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=window)
        self._draining = False
        self._task = asyncio.ensure_future(self._pump(requests))

    async def _pump(self, requests: AsyncIterator) -> None:
        try:
            async for request in requests:
                if not self._draining:
                    await self._queue.put(request)
        except Exception as error:  # a message that did not parse: handed to the reader
            if not self._draining:
                await self._queue.put(error)
        finally:
            if not self._draining:
                await self._queue.put(_END)

    async def __aiter__(self):
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item

    async def drain(self) -> None:
        """Drop what is buffered and every message still to come; returns when the client's stream
        ends, or after DRAIN_TIMEOUT_S."""
        self._draining = True
        while not self._queue.empty():
            self._queue.get_nowait()
        await asyncio.wait([self._task], timeout=DRAIN_TIMEOUT_S)
        self._task.cancel()

    def cancel(self) -> None:
        self._task.cancel()
