"""Residency and lease counts reported by decoders, and two-phase drains.

Decoders count leases locally and report `{digest: leases}` periodically (the recommended lease
protocol in ARCHITECTURE.md): the registry is off the per-token path and a registry restart
stops no request. A drain marks a digest; each decoder learns it from the answer to its next
report, refuses new admissions for it, and acknowledges it in the report after. The digest is
drained when every live decoder has acknowledged it and reports zero leases for it:

    registry: start_drain(d) ............................. drained(d)?
    decoder:        report -> ack{d} | refuse admissions | report(acked={d}, leases[d]=0)

Reports older than `ttl_s` are ignored (that decoder is gone). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DecoderReport:
    resident: dict[str, int]              # digest -> leases
    draining_acked: frozenset[str]
    at: float = field(default_factory=time.monotonic)


class LeaseTable:
    def __init__(self, ttl_s: float = 10.0) -> None:
        self.ttl_s = ttl_s
        self._reports: dict[str, DecoderReport] = {}
        self._draining: dict[str, int] = {}  # digest -> number of drains waiting on it
        self._lock = threading.Lock()

    def report(self, decoder_id: str, resident: dict[str, int], draining_acked: set[str]) -> list[str]:
        """Record one decoder's report; returns the digests being drained."""
        with self._lock:
            self._reports[decoder_id] = DecoderReport(dict(resident), frozenset(draining_acked))
            return sorted(self._draining)

    def residency(self, digest: str) -> list[tuple[str, int]]:
        """(decoder id, leases) for every live decoder holding `digest`, by decoder id."""
        with self._lock:
            return sorted((d, r.resident[digest]) for d, r in self._live() if digest in r.resident)

    def leases(self, digest: str) -> int:
        return sum(n for _, n in self.residency(digest))

    def holders(self, digest: str, since: float) -> tuple[list[tuple[str, int]], bool]:
        """(decoder id, leases) for live decoders reporting leases on `digest`, and whether every
        one of those reports is newer than `since` (time.monotonic())."""
        with self._lock:
            live = [(d, r) for d, r in self._live() if r.resident.get(digest, 0) > 0]
            return sorted((d, r.resident[digest]) for d, r in live), all(r.at > since for _, r in live)

    def is_draining(self, digest: str) -> bool:
        with self._lock:
            return digest in self._draining

    def start_drain(self, digest: str) -> None:
        with self._lock:
            self._draining[digest] = self._draining.get(digest, 0) + 1

    def end_drain(self, digest: str) -> None:
        with self._lock:
            count = self._draining.pop(digest, 0) - 1
            if count > 0:
                self._draining[digest] = count

    def drained(self, digest: str) -> bool:
        """True when every live decoder acknowledged the drain of `digest` with zero leases."""
        with self._lock:
            return all(digest in r.draining_acked and r.resident.get(digest, 0) == 0 for _, r in self._live())

    def _live(self) -> list[tuple[str, DecoderReport]]:
        now = time.monotonic()
        return [(d, r) for d, r in self._reports.items() if now - r.at <= self.ttl_s]
