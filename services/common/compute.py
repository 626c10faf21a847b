"""One compute thread per service process: the only thread that runs multi-threaded torch ops.

torch's CPU wheels parallelize ops with GNU OpenMP, which keeps a worker team for every thread
that ever entered a parallel region. Once those workers outnumber the CPUs, libgomp stops
spin-waiting between regions in *every* team (its "throttled" spin count), so each of the hundreds
of small ops in a forward pays a futex wake-up: on 2 cores a decode step run from a second thread
took ~20-25% longer than the same step on the thread that loaded the model. So a service loads and
runs its model on one thread (`claim_intra_op_threads` at that thread's start) and, once that
thread is up, `confine_other_threads` makes every other thread compute single-threaded (small ops
there — tensor decoding, prompt building — never start a team).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def claim_intra_op_threads(num_threads: int) -> None:
    """Call first on the compute thread: fixes its OpenMP team at `num_threads` (>= 1).

    The per-thread setting is taken now, so a later `confine_other_threads` elsewhere leaves it.
    """
    torch.set_num_threads(num_threads)
    torch.get_num_threads()  # initializes this thread's intra-op state with num_threads


def confine_other_threads() -> None:
    """Make threads other than the compute thread(s) already started run torch ops single-threaded.

    Process-wide for the calling thread and every thread that has not computed yet; call it from a
    service's main thread after its compute thread has claimed its threads (`serve` does, after
    `start`). A compute thread created afterwards gets one thread unless given `num_threads`.
    """
    torch.set_num_threads(1)


class ComputeThread:
    """A single worker thread that owns torch intra-op parallelism; `run`/`call` execute on it in order."""

    def __init__(self, name: str, num_threads: int | None = None) -> None:
        threads = num_threads or torch.get_num_threads()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=claim_intra_op_threads,
                                            initargs=(threads,))
        self._executor.submit(lambda: None).result()  # start the thread now: it claims its threads first

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run `fn` on the compute thread and wait (from a non-async caller)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run `fn` on the compute thread without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


_shared: ComputeThread | None = None
_shared_lock = threading.Lock()


def shared_compute_thread() -> ComputeThread:
    """The process's compute thread for services built on `ComputeThread` (pooling, vision),
    created on first use with torch's current thread count; every caller shares it."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ComputeThread("compute")
        return _shared
