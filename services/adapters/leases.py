"""Residency and lease counts reported by decoders, and two-phase drains.

Decoders count leases locally and report them periodically (the recommended lease protocol in
ARCHITECTURE.md): the registry is off the per-token path and a registry restart stops no
request. A report lists each resident digest with its leases split by the adapter name each
request was admitted under, so two names loaded from the same files (one digest) are drained and
unloaded independently. A drain marks a (name, digest) pair; each decoder learns it from the
answer to its next report, refuses new admissions of that name resolving to that digest, and
acknowledges it in the report after. The pair is drained when every live decoder has
acknowledged it and reports zero leases for it:

    registry: start_drain(ref) ............................. drained(ref)?
    decoder:        report -> ack{ref} | refuse admissions | report(acked={ref}, leases[ref]=0)

Reports older than `ttl_s` are ignored (that decoder is gone). Thread-safe.

A decoder takes a report's snapshot after the answer to its previous report has arrived (its
reports are sequential), but the snapshot is older than the report's arrival here by the time the
report spends in flight. So a count is known to be taken after an instant only when the decoder's
*previous* report arrived after it: the first report to arrive after an unload call may carry a
count from before it (a lease released since, or an admission missed), the second may not:

    registry:  ...report n arrives ... unload call ... report n+1 arrives ... report n+2 arrives
    decoder:   snapshot n+1 (before the call) ........ answer n+1 -> snapshot n+2 (after it)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

AdapterRef = tuple[str, str]  # (adapter name, weight digest)


@dataclass(frozen=True)
class DecoderReport:
    resident: dict[str, int]              # digest -> leases (all names)
    leases: dict[AdapterRef, int]         # (name, digest) -> leases of requests admitted as that name
    draining_acked: frozenset[AdapterRef]
    at: float = field(default_factory=time.monotonic)
    previous_at: float | None = None      # arrival of the decoder's previous report: its snapshot is newer


class LeaseTable:
    def __init__(self, ttl_s: float = 10.0) -> None:
        self.ttl_s = ttl_s
        self._reports: dict[str, DecoderReport] = {}
        self._draining: dict[AdapterRef, int] = {}  # ref -> number of drains waiting on it
        self._lock = threading.Lock()

    def report(self, decoder_id: str, resident: dict[str, int], leases: dict[AdapterRef, int],
               draining_acked: set[AdapterRef]) -> list[AdapterRef]:
        """Record one decoder's report; returns the (name, digest) pairs being drained."""
        with self._lock:
            previous = self._reports.get(decoder_id)
            self._reports[decoder_id] = DecoderReport(dict(resident), dict(leases), frozenset(draining_acked),
                                                      previous_at=previous.at if previous else None)
            return sorted(self._draining)

    def residency(self, ref: AdapterRef) -> list[tuple[str, int]]:
        """(decoder id, leases taken as ref's name) for every live decoder holding ref's digest."""
        with self._lock:
            return sorted((d, r.leases.get(ref, 0)) for d, r in self._live() if ref[1] in r.resident)

    def reported_since(self, since: float) -> bool:
        """Whether every live decoder's last report was counted after `since` (time.monotonic()),
        i.e. its previous report arrived after `since` (see the module docstring): an older count
        may be from a request that has finished since, and may miss one admitted since."""
        with self._lock:
            return all(r.previous_at is not None and r.previous_at > since for _, r in self._live())

    def is_draining(self, ref: AdapterRef) -> bool:
        with self._lock:
            return ref in self._draining

    def start_drain(self, ref: AdapterRef) -> None:
        with self._lock:
            self._draining[ref] = self._draining.get(ref, 0) + 1

    def end_drain(self, ref: AdapterRef) -> None:
        with self._lock:
            count = self._draining.pop(ref, 0) - 1
            if count > 0:
                self._draining[ref] = count

    def drained(self, ref: AdapterRef) -> bool:
        """True when every live decoder acknowledged the drain of `ref` with zero leases on it."""
        with self._lock:
            return all(ref in r.draining_acked and r.leases.get(ref, 0) == 0 for _, r in self._live())

    def _live(self) -> list[tuple[str, DecoderReport]]:
        now = time.monotonic()
        return [(d, r) for d, r in self._reports.items() if now - r.at <= self.ttl_s]
