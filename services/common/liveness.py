"""Whether a service's work loop (decoder engine, pooling batcher, vision encoder) still works.

A loop is unhealthy when it has died (it records the cause with `die`) or is wedged: work is
waiting and no step has completed for `wedged_after_s` seconds. Progress is counted in completed
steps, never in requests served or tokens produced, and the clock starts when the check first sees
work after an idle spell (a verdict comes between `wedged_after_s` and that plus two polls): a busy
engine whose oldest request has waited minutes is not wedged while its steps complete, nor is an
idle one. A single step longer than `wedged_after_s` does count, so the bound must exceed the
longest step (a full-budget prefill); the default is 60 s.

The loop only bumps `num_steps` (an int increment: no lock, no syscall); `check` is polled by the
server's health task (services/common/server.py) on the event loop.
"""

from __future__ import annotations

import time

from services.common.errors import Unavailable

DEFAULT_WEDGED_AFTER_S = 60.0


def check_wedged_after_s(value: float) -> None:
    """Raises ValueError unless `value` (seconds) is positive."""
    if not value > 0:
        raise ValueError(f"wedged_after_s must be > 0 seconds, got {value}")


def describe(cause: BaseException) -> str:
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


class Liveness:
    """Died-or-wedged state of one work loop.

    Args:
        what: the loop, as messages name it ("the decoder engine").
        wedged_after_s: seconds without a completed step, while work waits, before it is wedged.
    """

    def __init__(self, what: str, wedged_after_s: float = DEFAULT_WEDGED_AFTER_S) -> None:
        check_wedged_after_s(wedged_after_s)
        self.what = what
        self.wedged_after_s = wedged_after_s
        self.num_steps = 0                        # bumped by the loop after every step, failed or not
        self.cause: BaseException | None = None   # why the loop died; None while it runs
        self._seen_steps = 0
        self._idle = True
        self._progress_s = time.monotonic()       # when work or a completed step was last first seen

    def die(self, cause: BaseException) -> None:
        """Record that the loop has stopped for good because of `cause`."""
        self.cause = cause

    def dead_error(self) -> Unavailable:
        """The error every pending and later request gets once the loop has died."""
        return Unavailable(f"{self.what} stopped: {describe(self.cause)}; this replica must be restarted")

    def raise_if_dead(self) -> None:
        """Raises Unavailable naming the cause when the loop has died."""
        if self.cause is not None:
            raise self.dead_error()

    def check(self, has_work: bool, now: float | None = None) -> str | None:
        """None while healthy, else why not (stable text: the caller logs it once).

        `has_work`: work is queued or in a step now. `now`: time.monotonic() seconds.
        """
        if self.cause is not None:
            return f"{self.what} stopped: {describe(self.cause)}"
        now = time.monotonic() if now is None else now
        if not has_work:
            self._idle = True
            return None
        if self._idle or self.num_steps != self._seen_steps:  # the clock starts when work or a step is seen
            self._idle, self._seen_steps, self._progress_s = False, self.num_steps, now
            return None
        if now - self._progress_s >= self.wedged_after_s:
            return f"{self.what} is wedged: work is waiting and no step completed in {self.wedged_after_s:g} s"
        return None
