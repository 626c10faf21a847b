"""`DynamicBatcher`: sequences from concurrent requests gathered into forwards grouped by length.

Each request puts its sequences on a bounded FIFO queue and awaits one future per sequence. A
drain task, started on demand in the running event loop, repeatedly:

  1. holds the oldest sequence up to `max_wait_s` for company, unless the queue already holds
     more than one forward;
  2. sorts the queued sequences by length (the oldest first, up to `WINDOW_BUDGETS` budgets of
     real tokens) and cuts the sorted run into groups (`group_by_length`): a group ends where the
     next sequence would pass `max_batch_tokens` (padded length x rows, TEI's token-budget rule)
     or pad more than `MAX_PADDING_SHARE` of its real tokens; it takes the group holding the
     oldest sequence, so every forward serves the oldest waiting sequence and none waits for more
     forwards than there are sequences queued before it;
  3. runs the forward on the service's compute thread (one forward at a time across its models),
     and resolves the futures, so every request gets its rows in its own order.

    queue (oldest first)  [a:12][b:230][c:8][d:14][e:240]       budget 16384
    sorted                [c:8][a:12][d:14] | [b:230][e:240]    -> forward [c a d] (3 x 14), then [b e]

Padding every sequence to the longest of the queue would cost 5 x 240 = 1200 tokens; the groups
cost 42 + 480. While a forward runs, new requests queue; they join the next plan. A request
whose sequences would push the queue past `max_queue_size` is refused (RESOURCE_EXHAUSTED) before
anything is queued. Cancelled requests' sequences are skipped. With `enabled=False` each request
is one forward of its own, in turn: the per-call lock baseline.

A step that fails (forming the batch, the forward, handing rows out) fails that batch's requests
and the drain goes on. Should the drain task end anyway, every queued and later request fails at
once with UNAVAILABLE naming the cause, and `health()` says so (as it does when no forward
completes while sequences wait: services/common/liveness.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.compute import ComputeThread
from services.common.errors import ResourceExhausted
from services.common.liveness import DEFAULT_WEDGED_AFTER_S, Liveness
from services.pooling.stats import BatcherStats
from services.pooling.tokens import Sequence

log = logging.getLogger(__name__)

# A group may pad up to this share of its real tokens (or MIN_PADDING_TOKENS, whichever is more)
# before the next, longer sequence starts a new forward: each forward has a fixed cost, so cutting
# at every length step would trade padding for per-forward overhead.
MAX_PADDING_SHARE = 0.5
MIN_PADDING_TOKENS = 128
# How much of the queue one plan sorts, in budgets of real tokens: enough to group a large
# request's sequences, bounded so a long queue costs each step a bounded sort.
WINDOW_BUDGETS = 4


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
        wedged_after_s: seconds with sequences waiting and no forward completed before `health()`
            reports the batcher wedged.
    """

    def __init__(self, name: str, forward: Callable[[list[Sequence]], torch.Tensor], compute: ComputeThread,
                 max_batch_tokens: int, max_wait_s: float, max_queue_size: int, enabled: bool = True,
                 wedged_after_s: float = DEFAULT_WEDGED_AFTER_S):
        self.name, self._forward, self._compute = name, forward, compute
        self.max_batch_tokens, self.max_wait_s, self.max_queue_size = max_batch_tokens, max_wait_s, max_queue_size
        self.enabled = enabled
        self._queue: collections.deque[_Pending] = collections.deque()
        self._batch: list[_Pending] = []  # in the forward now
        self._num_computing = 0             # sequences in a forward now, either mode
        self.liveness = Liveness(f"model {name!r}'s batcher", wedged_after_s)
        self.stats = BatcherStats(name)
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

    def health(self) -> str | None:
        """None while the batcher works; else why not (its drain died, or it is wedged)."""
        return self.liveness.check(self._num_waiting > 0 or self._num_computing > 0)

    async def submit(self, sequences: list[Sequence]) -> torch.Tensor:
        """Run `sequences` (possibly beside other requests' sequences); rows come back in input order.

        Raises:
            ResourceExhausted: the queue cannot take them (the message gives the counts and the limit).
            Unavailable: the batcher's drain task has stopped (also raised for sequences it held).
        """
        self.liveness.raise_if_dead()
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
        self.stats.on_request_done(now)
        return torch.stack(rows)

    async def _submit_locked(self, sequences: list[Sequence]) -> torch.Tensor:
        started = False
        try:
            async with self._loop_lock():
                self._num_waiting -= len(sequences)
                started = True
                self.batch_shapes.append((len(sequences), max(map(len, sequences))))
                self._num_computing = len(sequences)
                try:
                    rows = await self._compute.run(self._forward, sequences)
                except asyncio.CancelledError:  # the caller gave up; the forward may still run: no progress
                    raise
                except Exception:
                    self.liveness.num_steps += 1
                    raise
                finally:
                    self._num_computing = 0
                self.liveness.num_steps += 1
                return rows
        finally:
            if not started:  # cancelled while waiting for the lock
                self._num_waiting -= len(sequences)

    def _loop_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock_by_loop is None or self._lock_by_loop[0] is not loop:
            self._lock_by_loop = (loop, asyncio.Lock())
        return self._lock_by_loop[1]

    async def _drain(self) -> None:
        try:
            while self._queue:
                await self._step()
                self.liveness.num_steps += 1
        except asyncio.CancelledError:
            raise
        except BaseException as cause:  # the drain ends here; its callers must hear why
            log.critical("%s stopped; failing every queued request", self.liveness.what, exc_info=cause)
            self._die(cause)

    async def _step(self) -> None:
        """Form one batch, run its forward and hand the rows out; an error fails this batch only
        (when forming the batch fails, the oldest sequence, so the next step moves on)."""
        try:
            await self._hold()
            self._batch = self._take()
            if not self._batch:
                return
            self.batch_shapes.append((len(self._batch), max(len(item.sequence) for item in self._batch)))
            self._num_computing = len(self._batch)
            self.stats.on_batch(self._batch)
            out = await self._compute.run(self._forward, [item.sequence for item in self._batch])
            self.stats.on_forward_end()
            for item, row in zip(self._batch, out, strict=True):
                if not item.future.done():
                    item.future.set_result(row)
        except Exception as error:  # handed to every request in the batch
            if not self._batch and self._queue:
                self._batch = [self._queue.popleft()]
                self._num_waiting -= 1
            log.warning("%s: a step failed: %r", self.liveness.what, error)
            _fail(self._batch, error)
        self._batch, self._num_computing = [], 0  # kept on a fatal error, for `_die` to fail

    def _die(self, cause: BaseException) -> None:
        """Fail every held sequence, now and later, with Unavailable naming `cause`."""
        self.liveness.die(cause)
        _fail([*self._batch, *self._queue], self.liveness.dead_error())
        self._queue.clear()
        self._batch, self._num_waiting, self._num_computing = [], 0, 0

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
        """The queue no longer fits one padded forward: waiting longer only delays the oldest. (Not
        "the oldest's length group is smaller than the queue": one short and one long sequence
        would end every hold at once, and mixed traffic would run one-row forwards.)"""
        longest = max(len(item.sequence) for item in self._queue)
        return len(self._queue) > 1 and len(self._queue) * longest > self.max_batch_tokens

    def _window(self) -> list[_Pending]:
        """The oldest queued sequences up to WINDOW_BUDGETS x max_batch_tokens real tokens (at least one)."""
        window, num_tokens = [], 0
        for item in self._queue:
            if window and num_tokens + len(item.sequence) > WINDOW_BUDGETS * self.max_batch_tokens:
                break
            window.append(item)
            num_tokens += len(item.sequence)
        return window

    def _next_group(self) -> list[_Pending]:
        """The length group, of the queue's window, that holds the oldest sequence (shortest first)."""
        window = self._window()
        groups = group_by_length([len(item.sequence) for item in window], self.max_batch_tokens)
        return [window[i] for i in next(group for group in groups if 0 in group)]

    def _take(self) -> list[_Pending]:
        group = self._next_group()
        taken = {id(item) for item in group}
        self._queue = collections.deque(item for item in self._queue if id(item) not in taken)
        self._num_waiting -= len(group)
        return [item for item in group if not item.future.done()]  # cancelled requests drop out


def group_by_length(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Cut sequences into forwards by length: indices into `lengths`, each group shortest first.

    The indices are sorted by length (ties in input order) and cut where adding the next sequence
    would make rows x its length pass `max_batch_tokens`, or the group's padding (rows x longest
    minus real tokens) pass max(MIN_PADDING_TOKENS, MAX_PADDING_SHARE x real tokens). A sequence
    longer than the budget is a group of its own (config keeps max_input_length within it).

        lengths [12, 230, 8, 14, 240]  ->  [[2, 0, 3], [1, 4]]
    """
    groups: list[list[int]] = []
    group: list[int] = []
    num_real = 0
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        length = lengths[index]
        padded, real = (len(group) + 1) * length, num_real + length
        if group and (padded > max_batch_tokens
                      or padded - real > max(MIN_PADDING_TOKENS, MAX_PADDING_SHARE * real)):
            groups.append(group)
            group, real = [], length
        group.append(index)
        num_real = real
    if group:
        groups.append(group)
    return groups


def _fail(items: list[_Pending], error: BaseException) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(error)
