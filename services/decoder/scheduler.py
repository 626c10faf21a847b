"""Continuous batching: decodes first, then (chunked) prefills, recompute preemption.

Each step spends at most `max_num_batched_tokens` tokens over at most `max_num_seqs` running
requests. A running request needs `num_tokens - num_computed_tokens` new tokens (1 for a
decode, the rest of its prompt for an unfinished prefill); a prefill larger than the remaining
budget is cut into a chunk. When the pool runs out of blocks the latest admitted request is
preempted: its blocks are freed and it goes back to the front of the waiting queue, to recompute
prompt + generated tokens later (its adapter lease is kept). When every layer of the model attends
within one sliding window, a running request first releases its blocks wholly before the window of
its next position (BlockManager.release_before), as vLLM does.

Prefix cache: on admission a request takes the longest run of its full-block hashes that the
block manager has cached (never its last token, whose logits must be computed, nor a position
whose prompt logprobs are still to record: a request asking for them computes its whole prompt
unless another choice recorded them, as vLLM v1 skips the cache for such requests) and starts
computing after it; after each step newly full computed blocks are registered. Choices 1..n-1 of
a request wait (head of the queue) until choice 0 has computed the prompt, then reuse its blocks.

longrope (rotary.LongRope): a running request whose tokens outgrow original_max_position_embeddings
has computed its K/V on the short factors; as transformers' Phi-3 generate does, they are
recomputed on the long ones: its blocks are freed and it prefills all its tokens again, still
running (no preemption, no lease change).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.common.errors import ResourceExhausted
from services.decoder.block_manager import BlockManager
from services.decoder.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """Positions [start, start + num_new_tokens) of `request` run this step (fixed at scheduling)."""

    request: Request
    num_new_tokens: int
    start: int = field(init=False)
    samples: bool = field(init=False)  # the chunk reaches the request's last token, so its logits are sampled

    def __post_init__(self) -> None:
        self.start = self.request.num_computed_tokens
        self.samples = self.end == self.request.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_waiting: int, sliding_window: int | None = None) -> None:
        """`sliding_window`: the window every attention layer of the model shares (`model_sliding_window`),
        whose running requests release the blocks wholly before it; None: nothing is released."""
        self.block_manager = block_manager
        self.sliding_window = sliding_window
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, *requests: Request) -> None:
        """Queue requests (all or none). Raises ResourceExhausted past `max_waiting` waiting requests."""
        if len(self.waiting) + len(requests) > self.max_waiting:
            raise ResourceExhausted(f"{len(self.waiting)} requests are waiting and {len(requests)} more were "
                                    f"submitted; the queue holds {self.max_waiting}")
        for request in requests:
            request.status = RequestStatus.WAITING
            self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_computed_tokens and request.kv_long_rope != request.uses_long_rope:
                self.block_manager.free(request.key)  # computed on the short factors: recompute on the long
                request.num_computed_tokens = 0
            if self.sliding_window is not None:  # its first new position p attends p - window + 1 .. p
                first_attended = request.num_computed_tokens - self.sliding_window + 1
                self.block_manager.release_before(request.key, first_attended // self.block_manager.block_size)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.append_slots(request.key, request.num_computed_tokens + num_new):
                victim = self.running.pop()  # latest admitted; never one already scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.waits_for_parent():
                return
            cached = self._cached_prefix(request)
            num_computed = len(cached) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if self.block_manager.allocate(request.key, num_computed + num_new, cached) is None:
                return
            if request.hasher is not None:
                self.block_manager.record_lookup(request.num_tokens, num_computed)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

    def _cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks covering a prefix of the request, leaving at least its last token and every
        position whose prompt logprobs are still to record to compute (`Request.max_cached_tokens`)."""
        if request.hasher is None:
            return []
        max_blocks = request.max_cached_tokens // self.block_manager.block_size
        return self.block_manager.cached_prefix(request.block_hashes()[:max_blocks])

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.key)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput) -> None:
        """Record that every scheduled chunk was computed and cache the blocks it filled."""
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            request.kv_long_rope = request.uses_long_rope  # tokens are appended after this
            if request.hasher is not None:
                self.block_manager.cache_blocks(request.key, request.block_hashes(), request.num_computed_tokens)

    def finish(self, request: Request, reason: str) -> None:
        """Remove a request from whichever queue holds it and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request.key)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
