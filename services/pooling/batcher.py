"""`DynamicBatcher`: sequences from concurrent requests gathered into one forward per model.

Each request puts its sequences on a bounded FIFO queue and awaits one future per sequence. A
drain task, started on demand in the running event loop, repeatedly:

  1. holds the oldest sequence up to `max_wait_s` for company, unless the queue already fills
     the token budget;
  2. takes sequences in arrival order while padded length x rows stays within `max_batch_tokens`
     (TEI's token-budget rule; the first sequence always fits, as config guarantees);
  3. runs the forward on the service's compute thread (one forward at a time across its models),
     and resolves the futures.

    queue  [a:12][b:40][c:8][d:100] budget 128 -> batch [a b c] (3 x 40 = 120), d waits

While a forward runs, new requests queue; they form the next batch. A request whose sequences
would push the queue past `max_queue_size` is refused (RESOURCE_EXHAUSTED) before anything is
queued. Cancelled requests' sequences are skipped. With `enabled=False` each request is one
forward of its own, in turn: the per-call lock baseline.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.compute import ComputeThread
from services.common.errors import ResourceExhausted
from services.pooling.tokens import Sequence


@dataclass
class _Pending:
    sequence: Sequence
    future: asyncio.Future
    arrival_s: float


class DynamicBatcher:
    """Batches `forward` calls for one model.

    Args:
        name: the model name (error messages).
        forward: list of sequences -> float32 tensor with one leading row per sequence (blocking).
        compute: the thread that runs every forward, shared by all models of a service (it runs one
            at a time, so models on one device never compute concurrently).
        max_batch_tokens: padded length x rows of one forward.
        max_wait_s: longest hold of the oldest queued sequence before its forward starts.
        max_queue_size: most sequences waiting (queued, not yet in a forward).
        enabled: False = one forward per request, serialized (no gathering).
    """

    def __init__(self, name: str, forward: Callable[[list[Sequence]], torch.Tensor], compute: ComputeThread,
                 max_batch_tokens: int, max_wait_s: float, max_queue_size: int, enabled: bool = True):
        self.name, self._forward, self._compute = name, forward, compute
        self.max_batch_tokens, self.max_wait_s, self.max_queue_size = max_batch_tokens, max_wait_s, max_queue_size
        self.enabled = enabled
        self._queue: collections.deque[_Pending] = collections.deque()
        self._num_waiting = 0
        self._drainer: asyncio.Task | None = None
        self._arrived: asyncio.Event | None = None
        self._lock_by_loop: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        # (rows, padded length) of recent forwards, for Info-style introspection and tests
        self.batch_shapes: collections.deque[tuple[int, int]] = collections.deque(maxlen=1024)

    @property
    def num_waiting(self) -> int:
        """Sequences accepted and not yet in a forward."""
        return self._num_waiting

    async def submit(self, sequences: list[Sequence]) -> torch.Tensor:
        """Run `sequences` (possibly beside other requests' sequences); rows come back in input order.

        Raises:
            ResourceExhausted: the queue cannot take them (the message gives the counts and the limit).
        """
        if self._num_waiting + len(sequences) > self.max_queue_size:
            raise ResourceExhausted(
                f"model {self.name!r} has {self._num_waiting} sequences queued and this request adds "
                f"{len(sequences)}; max_queue_size is {self.max_queue_size}; retry later")
        self._num_waiting += len(sequences)
        if not self.enabled:
            return await self._submit_locked(sequences)
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        items = [_Pending(seq, loop.create_future(), now) for seq in sequences]
        self._queue.extend(items)
        if self._arrived is not None:
            self._arrived.set()
        if self._drainer is None or self._drainer.done() or self._drainer.get_loop() is not loop:
            self._drainer = loop.create_task(self._drain())
        rows = await asyncio.gather(*(item.future for item in items))
        return torch.stack(rows)

    async def _submit_locked(self, sequences: list[Sequence]) -> torch.Tensor:
        started = False
        try:
            async with self._loop_lock():
                self._num_waiting -= len(sequences)
                started = True
                self.batch_shapes.append((len(sequences), max(map(len, sequences))))
                return await self._compute.run(self._forward, sequences)
        finally:
            if not started:  # cancelled while waiting for the lock
                self._num_waiting -= len(sequences)

    def _loop_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock_by_loop is None or self._lock_by_loop[0] is not loop:
            self._lock_by_loop = (loop, asyncio.Lock())
        return self._lock_by_loop[1]

    async def _drain(self) -> None:
        while self._queue:
            await self._hold()
            batch = self._take()
            if not batch:
                continue
            self.batch_shapes.append((len(batch), max(len(item.sequence) for item in batch)))
            try:
                out = await self._compute.run(self._forward, [item.sequence for item in batch])
            except Exception as error:  # noqa: BLE001 - handed to every request in the batch
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(error)
                continue
            for item, row in zip(batch, out, strict=True):
                if not item.future.done():
                    item.future.set_result(row)

    async def _hold(self) -> None:
        """Wait for more sequences until the budget is full or the oldest has waited max_wait_s."""
        deadline = self._queue[0].arrival_s + self.max_wait_s
        while not self._budget_full():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._arrived = asyncio.Event()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return
            finally:
                self._arrived = None

    def _budget_full(self) -> bool:
        return self._num_fitting() < len(self._queue)

    def _num_fitting(self) -> int:
        """How many queued sequences, oldest first, fit one forward (at least one)."""
        count, max_len = 0, 0
        for item in self._queue:
            longest = max(max_len, len(item.sequence))
            if count and (count + 1) * longest > self.max_batch_tokens:
                break
            count, max_len = count + 1, longest
        return count

    def _take(self) -> list[_Pending]:
        num = self._num_fitting()
        taken = [self._queue.popleft() for _ in range(num)]
        self._num_waiting -= num
        return [item for item in taken if not item.future.done()]  # cancelled requests drop out
