"""Bounded LRU cache of encoder outputs, keyed by content hash.

The key is the image's content hash: sha256 over the encoded image bytes, the preprocessing
recipe (ProcessorConfig fingerprint, including the Qwen2-VL min/max pixels) and the encoder
revision (weights digest). Equal key => equal rows, so a hit can skip decoding and the encoder
alike; a change of weights or recipe changes every key, so stale rows are never served.

Size is counted in bytes of the cached rows (float32 [P, hidden] -> 4 * P * hidden); the least
recently used entries are evicted until the new one fits. An entry larger than the whole cache
is not stored. Thread-safe: the servicer decodes in worker threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from services.vision.encoder import EncoderOutput


@dataclass(frozen=True)
class EncoderCacheStats:
    """Counters since start. `bytes` / `capacity_bytes` are the rows' tensor bytes."""

    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    capacity_bytes: int


def output_bytes(output: EncoderOutput) -> int:
    return output.rows.numel() * output.rows.element_size()


class EncoderCache:
    """`get` / `put` by content hash; `capacity_bytes` 0 disables caching (every lookup misses)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, EncoderOutput] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def peek(self, key: str) -> EncoderOutput | None:
        """The cached output or None, counting nothing and leaving the LRU order: a request's checks
        look before it is admitted, and `count` records the lookup once it is."""
        with self._lock:
            return self._entries.get(key)

    def count(self, key: str, hit: bool) -> None:
        """Record one lookup of `key` (a hit marks the entry most recently used)."""
        with self._lock:
            if hit:
                self._hits += 1
                if key in self._entries:
                    self._entries.move_to_end(key)
            else:
                self._misses += 1

    def get(self, key: str) -> EncoderOutput | None:
        """The cached output (marked most recently used) or None; counts a hit or a miss."""
        with self._lock:
            output = self._entries.get(key)
            if output is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return output

    def put(self, key: str, output: EncoderOutput) -> bool:
        """Store `output`, evicting LRU entries to make room. False when it cannot fit at all."""
        size = output_bytes(output)
        with self._lock:
            if size > self.capacity_bytes:
                return False
            previous = self._entries.pop(key, None)
            if previous is not None:
                self._bytes -= output_bytes(previous)
            while self._bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= output_bytes(evicted)
                self._evictions += 1
            self._entries[key] = output
            self._bytes += size
            return True

    def stats(self) -> EncoderCacheStats:
        with self._lock:
            return EncoderCacheStats(hits=self._hits, misses=self._misses, evictions=self._evictions,
                                     entries=len(self._entries), bytes=self._bytes,
                                     capacity_bytes=self.capacity_bytes)
