"""The cache-aware policy: which decoder replica serves a Generate, by prefix affinity, adapter
affinity and load, scored per replica.

The gateway scores replicas itself, as llm-d's endpoint picker and SGLang's cache-aware router do.
This module is pure (no I/O, no clock of its own): the decoder pool (services/gateway/pools.py)
feeds it each replica's reported load and readiness, `bench/route.py --simulate` feeds it
simulated replicas.

Prefix affinity. The gateway has no tokenizer, so a request's canonical content (`RoutingKey`:
chat messages rendered role + text in order, or the raw prompt, as UTF-8) is cut into fixed-size
blocks of `block_bytes` bytes and hashed as a chain, in the decoder's manner
(services/decoder/prefix_cache.py):

    hash(block i) = sha256( parent | block bytes | extra keys of block i )
    parent        = hash(block i-1), or 32 zero bytes for block 0
    extra keys    = "lora:<adapter name>" on every block when the request has an adapter,
                    "image:<content hash>" on the block where each image sits

`PrefixIndex` remembers, for a bounded number of block hashes (LRU), which replicas were sent a
request holding that block. A conversation's next turn repeats the previous turn's content and
so its leading blocks: the replica holding the longest run of them holds its KV blocks. The
index is approximate (a replica may have evicted blocks; the index never hears of it) and only
ever a preference.

Scoring, in units of one queued request (higher wins):

    score(r) = prefix_weight * (matched(r) - least matched) / num_blocks  if gap(r) <= max_queue_gap
             + (adapter_queue_gap + 1/2) * [adapter resident on r]  if gap(r) <= adapter_queue_gap
             - gap(r) - kv_weight * kv_usage(r)
    matched(r) = leading blocks of the request that r holds (least matched: the minimum over ready
               replicas, so a system prompt every replica holds decides nothing)
    gap(r)   = queue(r) - min over ready replicas of queue
    queue(r) = the gateway's own requests in flight on r (policy.InFlight) + what r last reported
               running or waiting beyond those (other gateways' requests)

So affinity never sends a request to a replica whose queue is more than `max_queue_gap` longer
than the shortest, and a hot adapter stays on the replica holding it only while that replica's
queue is within `adapter_queue_gap` of the shortest; past that the request goes elsewhere, that
replica loads the adapter, and from then on both hold it and share its requests by load (a
bounded spread instead of one replica thrashing its slots). Ties go to the replica with fewer
requests in flight, then round robin.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from services.gateway.routing.policy import Decision, InFlight, ReplicaReport, RoutingKey, RoutingPolicy

ROOT_PARENT = bytes(32)


def _keys_bytes(extra_keys: Sequence[str]) -> bytes:
    return b"".join(struct.pack("<q", len(data)) + data for data in (key.encode() for key in extra_keys))


def block_hashes(key: RoutingKey, block_bytes: int) -> list[bytes]:
    """Chain hashes of every full `block_bytes`-byte block of `key.content` (a partial tail is not hashed)."""
    lora = _keys_bytes([f"lora:{key.adapter}"] if key.adapter else [])
    size = struct.pack("<q", block_bytes)
    sha256, content = hashlib.sha256, key.content
    hashes: list[bytes] = []
    parent = ROOT_PARENT
    for index in range(len(content) // block_bytes):
        lo, hi = index * block_bytes, (index + 1) * block_bytes
        extra = lora
        if key.image_offsets:
            extra += _keys_bytes([f"image:{h}" for offset, h in key.image_offsets if lo <= offset < hi])
        parent = sha256(parent + size + content[lo:hi] + extra).digest()
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Bounded LRU map: block hash -> replicas sent a request holding that block."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"prefix index capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def insert(self, hashes: Sequence[bytes], replica: str) -> None:
        for h in hashes:
            holders = self._holders.pop(h, None) or set()
            holders.add(replica)
            self._holders[h] = holders  # most recently used end
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def matched_blocks(self, hashes: Sequence[bytes], replica: str) -> int:
        """Length of the leading run of `hashes` that `replica` holds."""
        count = 0
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None or replica not in holders:
                break
            count += 1
        return count

    def matched_by_replica(self, hashes: Sequence[bytes], replicas: Collection[str]) -> dict[str, int]:
        """`matched_blocks` of each of `replicas`, in one walk of the chain."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(matched)
        for depth, h in enumerate(hashes):
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for replica in alive:
                matched[replica] = depth + 1
        return matched

    def forget(self, replica: str) -> None:
        """Drop `replica` everywhere (it restarted or left: its KV cache is gone)."""
        for h in [h for h, holders in self._holders.items() if replica in holders]:
            holders = self._holders[h]
            holders.discard(replica)
            if not holders:
                del self._holders[h]


@dataclass(frozen=True)
class RouterConfig:
    """Weights and bounds of the score (module docstring). Queue gaps count requests."""

    block_bytes: int = 64              # ~16 tokens of English text, the decoder's default block
    index_capacity: int = 200_000      # block hashes remembered (~100 bytes each)
    prefix_weight: float = 4.5         # a full match outweighs a queue up to max_queue_gap longer
    kv_weight: float = 1.0
    max_queue_gap: int = 4
    adapter_queue_gap: int = 2
    adapter_memory_s: float = 5.0      # a routed adapter counts as resident this long before a report shows it

    def __post_init__(self) -> None:
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {self.block_bytes}")
        if self.index_capacity < 1:
            raise ValueError(f"index_capacity must be >= 1, got {self.index_capacity}")
        for name in ("prefix_weight", "kv_weight", "adapter_memory_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.adapter_queue_gap <= self.max_queue_gap:
            raise ValueError(f"adapter_queue_gap must be in 0..max_queue_gap ({self.max_queue_gap}), "
                             f"got {self.adapter_queue_gap}")


@dataclass
class ReplicaLoad:
    """What a replica's last report (GetInfo) and the routing so far say of it, beside the
    gateway's own requests in flight there (policy.InFlight)."""

    num_others: int = 0                # reported running + waiting requests that are not the gateway's
    kv_usage: float = 0.0              # fraction of KV blocks in use, 0..1
    resident_adapters: frozenset[str] = frozenset()
    routed_adapters: dict[str, float] = field(default_factory=dict)  # name -> when last routed there


class CacheAwarePolicy(RoutingPolicy):
    """Scores ready replicas for each request (module docstring) and learns from its decisions.

    Replicas are named by their address. `loads` holds what is known of every replica; the pool
    keeps it current (`report`, `remove`) and says which are ready at each `pick`; the gateway's
    requests in flight come from `in_flight`.
    """

    def __init__(self, config: RouterConfig | None = None, in_flight: InFlight | None = None) -> None:
        super().__init__(in_flight)
        self.config = config or RouterConfig()
        self.index = PrefixIndex(self.config.index_capacity)
        self.loads: dict[str, ReplicaLoad] = {}
        self._round_robin = itertools.count()

    def load(self, replica: str) -> ReplicaLoad:
        return self.loads.setdefault(replica, ReplicaLoad())

    def queue(self, replica: str) -> int:
        """The gateway's own count is fresh; a report (up to a poll interval old) adds only what
        other clients (other gateways) have queued there."""
        return self.in_flight[replica] + self.load(replica).num_others

    def report(self, replica: str, report: ReplicaReport) -> None:
        load = self.load(replica)
        own = max(self.in_flight[replica], report.num_in_flight_then or 0)
        load.num_others = max(0, report.num_running + report.num_waiting - own)
        load.kv_usage = report.kv_usage
        load.resident_adapters = frozenset(report.resident_adapters)

    def remove(self, replica: str) -> None:
        """The replica left or restarted: forget its reported load, adapters and prefixes."""
        self.loads.pop(replica, None)
        self.index.forget(replica)

    def resident(self, replica: str, adapter: str, now: float) -> bool:
        load = self.load(replica)
        routed = load.routed_adapters.get(adapter)
        return adapter in load.resident_adapters or (
            routed is not None and now - routed <= self.config.adapter_memory_s)

    def pick(self, key: RoutingKey | None, ready: Sequence[str], now: float = 0.0,
             hashes: Sequence[bytes] | None = None) -> Decision | None:
        """The best of `ready` for `key` (None when `ready` is empty); records the decision.

        `key` None: load alone decides. `hashes`: `block_hashes(key, block_bytes)` when the caller
        has them already.
        """
        if not ready:
            return None
        cfg = self.config
        key = key or RoutingKey(b"")
        hashes = block_hashes(key, cfg.block_bytes) if hashes is None else hashes
        queues = {r: self.queue(r) for r in ready}
        shortest = min(queues.values())
        matched = self.index.matched_by_replica(hashes, ready)
        least_matched = min(matched.values())
        turn = next(self._round_robin)
        best: tuple | None = None
        for position, replica in enumerate(ready):
            load = self.load(replica)
            gap = queues[replica] - shortest
            score = -gap - cfg.kv_weight * load.kv_usage
            if hashes and gap <= cfg.max_queue_gap:
                score += cfg.prefix_weight * (matched[replica] - least_matched) / len(hashes)
            resident = bool(key.adapter) and self.resident(replica, key.adapter, now)
            if resident and gap <= cfg.adapter_queue_gap:
                score += cfg.adapter_queue_gap + 0.5  # outweighs any gap up to adapter_queue_gap
            rank = (score, -self.in_flight[replica], -((position - turn) % len(ready)))
            if best is None or rank > best[0]:
                best = (rank, Decision(replica, matched[replica], len(hashes), resident))
        decision = best[1]
        self.record(key, decision.replica, now, hashes)
        return decision

    def record(self, key: RoutingKey, replica: str, now: float, hashes: Sequence[bytes] | None = None) -> None:
        """`replica` now holds `key`'s blocks and adapter (a routed or retried request)."""
        self.index.insert(block_hashes(key, self.config.block_bytes) if hashes is None else hashes, replica)
        if key.adapter:
            routed = self.load(replica).routed_adapters
            # names past their memory are dropped, so names clients invent cannot grow the table
            for name in [n for n, t in routed.items() if now - t > self.config.adapter_memory_s]:
                del routed[name]
            routed[key.adapter] = now
