"""The host-memory tier of adapter weights: swap-ins into a free slot copy from here."""

from __future__ import annotations

import threading
from collections import OrderedDict

from services.decoder.lora.slots import LoRAWeights


class HostAdapterCache:
    """The host-memory tier: adapter weights by digest, bounded by bytes, least recently used out.

    More adapters than device slots can be in use: a swap-in into an idle slot copies from here
    instead of fetching the weights from the registry again (and works while it is down).
    `max_bytes` counts the float32 A and B factors; 0 keeps nothing. With `pin_memory` (a decoder
    on CUDA) the factors are kept in page-locked memory, so a swap-in's host-to-device copy runs
    asynchronously (`AdapterSlots.load`) instead of staging through a pageable buffer.
    """

    def __init__(self, max_bytes: int, pin_memory: bool = False) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.pin_memory = pin_memory
        self.num_bytes = 0
        self._entries: OrderedDict[str, tuple[LoRAWeights, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, digest: str) -> LoRAWeights | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            self._entries.move_to_end(digest)
            return entry[0]

    def put(self, weights: LoRAWeights) -> LoRAWeights:
        """Keep `weights` (evicting the least recently used); one larger than max_bytes is not kept.

        Returns the weights to load into a slot: the kept copy (pinned with `pin_memory`), else `weights`.
        """
        size = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in weights.modules.values())
        if self.pin_memory and size <= self.max_bytes:
            weights = LoRAWeights(weights.digest, {name: (a.pin_memory(), b.pin_memory())
                                                   for name, (a, b) in weights.modules.items()})
        with self._lock:
            old = self._entries.pop(weights.digest, None)
            if old is not None:
                self.num_bytes -= old[1]
            if size > self.max_bytes:
                return weights
            while self.num_bytes + size > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.num_bytes -= evicted
            self._entries[weights.digest] = (weights, size)
            self.num_bytes += size
        return weights
