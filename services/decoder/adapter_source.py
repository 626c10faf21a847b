"""Where the engine's LoRA adapters come from: the `AdapterSource` interface and an in-memory one.

The engine owns the device slots (`AdapterSlots`, built with the model) and hands them to its
source in `start`; from then on an admission asks the source for a lease on a slot holding the
adapter a request names, and gives the lease back when the request ends. The registry client
(adapter_client.py) resolves names over gRPC; `InMemoryAdapterSource` serves weights it was given
(tests, embedding the engine in a process without a registry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod

from services.common.errors import NotFound
from services.common.names import check_adapter_name
from services.decoder.lora import AdapterSlots, LoRAWeights
from tessera.protocol import UNKNOWN_ADAPTER

log = logging.getLogger(__name__)


class AdapterSource(ABC):
    """Leases of adapter slots by adapter name.

    Contract: `start(slots)` is awaited once, on the event loop that serves requests, before the
    first `acquire`; `acquire(name)` returns a slot of `slots` holding `name`'s weights, leased
    under `name` (it may load them into an idle slot, and waits while every slot is leased);
    `share(slot, name)` takes one more lease on a slot the caller holds one on (the other choices
    of an n > 1 request); `release(slot, name)` ends one lease and may be called from any thread;
    `close()` ends background work. Every lease the engine holds is taken and given back here. Acquire raises InvalidArgument for a malformed name, NotFound for an
    unknown one, and the source's own errors (FailedPrecondition, Unavailable) before any lease.
    """

    slots: AdapterSlots | None = None
    num_weight_fetches = 0   # weight downloads (a registry source counts them)
    num_host_cache_hits = 0  # weight lookups a host-memory tier answered

    async def start(self, slots: AdapterSlots) -> None:
        """Serve leases of `slots` from now on."""
        self.slots = slots

    @abstractmethod
    async def acquire(self, name: str) -> int:
        """Lease a slot holding adapter `name`; returns the slot index."""

    def share(self, slot: int, name: str) -> int:
        """One more lease on `slot`, which the caller holds leased as adapter `name` (so its
        weights are resident: this never waits or loads); returns `slot` (thread-safe)."""
        shared = self.slots.acquire(self.slots.digest_of(slot), name)
        if shared != slot:
            raise RuntimeError(f"slot {slot} holds no leased adapter to share as {name!r}")
        return shared

    def release(self, slot: int, name: str) -> None:
        """End one lease on `slot` taken as adapter `name` (thread-safe)."""
        self.slots.release(slot, name)

    @abstractmethod
    def resident_names(self) -> list[str]:
        """Adapter names whose weights sit in a device slot now (sorted)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop background work; a later `acquire` may start it again."""


class InMemoryAdapterSource(AdapterSource):
    """Adapters given as weights by name: `add(name, weights)`; unknown names are NotFound."""

    def __init__(self, adapters: dict[str, LoRAWeights] | None = None, slot_wait_poll_s: float = 1.0) -> None:
        self.adapters = dict(adapters or {})
        self.slot_wait_poll_s = slot_wait_poll_s

    def add(self, name: str, weights: LoRAWeights) -> None:
        check_adapter_name(name)
        self.adapters[name] = weights

    async def acquire(self, name: str) -> int:
        check_adapter_name(name)
        weights = self.adapters.get(name)
        if weights is None:
            raise NotFound(f"unknown adapter {name!r}", reason=UNKNOWN_ADAPTER)
        while True:
            slot = self.slots.load_and_acquire(weights, name)
            if slot is not None:
                return slot
            await wait_for_free_slot(self.slots, name, self.slot_wait_poll_s)

    def resident_names(self) -> list[str]:
        with self.slots.lock:
            resident = set(self.slots.residency())
        return sorted(name for name, weights in self.adapters.items() if weights.digest in resident)

    async def close(self) -> None:
        """Nothing runs in the background."""


async def wait_for_free_slot(slots: AdapterSlots, name: str, poll_s: float) -> bool:
    """Wait, for an admission of adapter `name`, until `slots` has an unleased slot (woken by the
    release that frees one; re-checked every `poll_s` seconds). Returns False at once when one is
    free already, True after waiting."""
    loop = asyncio.get_running_loop()
    woken = loop.create_future()

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # that loop is closed: its admission is gone
            loop.call_soon_threadsafe(lambda: woken.done() or woken.set_result(None))

    if not slots.when_slot_frees(wake):
        return False
    log.info("adapter %r waits for one of %d leased adapter slots", name, slots.num_slots)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(woken, poll_s)
    return True
