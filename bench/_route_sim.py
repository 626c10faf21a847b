"""Discrete-event simulation of decoder replicas behind the gateway's router (bench/route.py --simulate).

Each simulated replica serves one request at a time, first come first served, with a prefix cache
(LRU of the router's block hashes, `kv_blocks` of them) and adapter slots (LRU of names). A
request's service time is

    uncached prompt tokens * prefill_s + output tokens * decode_s + swap_s if its adapter is not resident

(tokens = bytes / 4). The trace: multi-turn conversations that open with one of a few shared
system prompts, each with an adapter drawn from a Zipf law (or the base model), arriving in
bursts; a conversation's next turn arrives a think time after its previous turn finished and
repeats everything said so far. The policies see the same trace: the gateway's `CacheAwarePolicy` (fed
each replica's queue and resident adapters, as GetInfo would), round robin, and consistent hashing of
the first block (a ring with virtual nodes).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import random
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from services.gateway.routing import CacheAwarePolicy, ReplicaReport, RouterConfig, RoutingKey, block_hashes

BYTES_PER_TOKEN = 4


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = 4
    conversations_per_replica: int = 30
    turns: tuple[int, int] = (2, 6)            # turns per conversation, inclusive range
    num_system_prompts: int = 6
    system_bytes: tuple[int, int] = (1200, 3000)
    user_bytes: tuple[int, int] = (200, 1200)
    reply_bytes: tuple[int, int] = (120, 600)
    num_adapters: int = 24
    base_share: float = 0.3                    # conversations on the base model
    zipf_s: float = 1.1
    adapter_slots: int = 4
    kv_blocks: int = 2000                      # of the router's 64-byte blocks (~16 tokens each)
    prefill_s: float = 0.0017                  # per uncached prompt token (bench/results/prefix.md: 1.75 ms)
    decode_s: float = 0.012                    # per output token (bench/results/decode.md: ~85 tok/s)
    swap_s: float = 0.3                        # loading an adapter into a slot
    burst_size: tuple[int, int] = (1, 6)
    think_s: float = 3.0                       # mean pause between a reply and the next turn
    utilization: float = 0.7                   # offered load per replica (approximate)
    seed: int = 0


@dataclass
class Conversation:
    system: bytes
    adapter: str
    turns_left: int
    content: bytearray = field(default_factory=bytearray)


@dataclass
class SimReplica:
    name: str
    kv: OrderedDict = field(default_factory=OrderedDict)       # block hash -> None, LRU first
    slots: OrderedDict = field(default_factory=OrderedDict)    # adapter -> None, LRU first
    queue: deque = field(default_factory=deque)
    busy_until: float = 0.0
    busy: bool = False


@dataclass
class Result:
    policy: str
    num_replicas: int
    num_requests: int
    prefix_hit_rate: float        # prompt tokens served from a replica's prefix cache / prompt tokens
    adapter_swaps: int
    queue_imbalance: float        # mean over arrivals of (longest - shortest) queue
    mean_latency_s: float
    p95_latency_s: float


def _zipf_adapter(rng: random.Random, cfg: SimConfig) -> str:
    if rng.random() < cfg.base_share or cfg.num_adapters == 0:
        return ""
    weights = [1 / (k + 1) ** cfg.zipf_s for k in range(cfg.num_adapters)]
    return f"adapter-{rng.choices(range(cfg.num_adapters), weights)[0]}"


def _text(rng: random.Random, span: tuple[int, int]) -> bytes:
    n = rng.randint(*span)
    return rng.randbytes(n)


class Policy:
    name = ""

    def pick(self, key: RoutingKey, hashes: list[bytes], replicas: list[SimReplica], now: float) -> SimReplica:
        raise NotImplementedError

    def finished(self, replica: SimReplica) -> None:
        pass


class RouterPolicy(Policy):
    name = "router (prefix + adapter + load)"

    def __init__(self, config: RouterConfig) -> None:
        self.router = CacheAwarePolicy(config)

    def pick(self, key, hashes, replicas, now):
        by_name = {r.name: r for r in replicas}
        for r in replicas:  # what each replica's GetInfo would report
            self.router.report(r.name, ReplicaReport(int(r.busy), len(r.queue), 0.0, r.slots.keys()))
        replica = by_name[self.router.pick(key, list(by_name), now, hashes).replica]
        self.router.in_flight.started(replica.name)
        return replica

    def finished(self, replica):
        self.router.in_flight.finished(replica.name)


class RoundRobin(Policy):
    name = "round robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, key, hashes, replicas, now):
        return replicas[next(self._turn) % len(replicas)]


class ConsistentHash(Policy):
    name = "consistent hashing (first block)"

    def __init__(self, replicas: list[SimReplica], block_bytes: int, vnodes: int = 64) -> None:
        self.block_bytes = block_bytes
        points = sorted((self._hash(f"{r.name}#{v}".encode()), r.name) for r in replicas for v in range(vnodes))
        self._points = [p for p, _ in points]
        self._owners = [name for _, name in points]

    @staticmethod
    def _hash(data: bytes) -> int:
        return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")

    def pick(self, key, hashes, replicas, now):
        h = self._hash(key.adapter.encode() + b"\0" + key.content[:self.block_bytes])
        owner = self._owners[bisect.bisect(self._points, h) % len(self._points)]
        return next(r for r in replicas if r.name == owner)


def _trace(cfg: SimConfig, rng: random.Random) -> tuple[list[bytes], list[tuple[float, Conversation]]]:
    systems = [_text(rng, cfg.system_bytes) for _ in range(cfg.num_system_prompts)]
    # mean request service time, to size arrivals to the offered load
    mean_prompt = (sum(cfg.system_bytes) + sum(cfg.user_bytes) * 2) / 2 / BYTES_PER_TOKEN
    mean_service = mean_prompt * cfg.prefill_s * 0.5 + sum(cfg.reply_bytes) / 2 / BYTES_PER_TOKEN * cfg.decode_s
    mean_turns = sum(cfg.turns) / 2
    num_conversations = cfg.conversations_per_replica * cfg.num_replicas
    # each conversation occupies ~mean_turns services; spread their starts to reach the utilization
    rate = cfg.utilization * cfg.num_replicas / (mean_service * mean_turns)  # conversations per second
    arrivals, now = [], 0.0
    while len(arrivals) < num_conversations:
        burst = rng.randint(*cfg.burst_size)
        now += rng.expovariate(rate / ((cfg.burst_size[0] + cfg.burst_size[1]) / 2))
        for _ in range(min(burst, num_conversations - len(arrivals))):
            system = systems[min(int(rng.paretovariate(1.2)) - 1, len(systems) - 1)]
            arrivals.append((now, Conversation(system, _zipf_adapter(rng, cfg), rng.randint(*cfg.turns))))
    return systems, arrivals


def simulate(cfg: SimConfig, policy_name: str, router_config: RouterConfig | None = None) -> Result:
    """Replay the trace of `cfg` through one policy ("router", "round_robin", "consistent_hash")."""
    router_config = router_config or RouterConfig()
    rng = random.Random(cfg.seed)
    _, arrivals = _trace(cfg, rng)
    replicas = [SimReplica(f"replica-{i}") for i in range(cfg.num_replicas)]
    policy = {"router": lambda: RouterPolicy(router_config), "round_robin": RoundRobin,
              "consistent_hash": lambda: ConsistentHash(replicas, router_config.block_bytes)}[policy_name]()
    events: list = []  # (time, seq, kind, payload)
    seq = itertools.count()
    for t, conversation in arrivals:
        conversation.content.extend(b"system:" + conversation.system + b"\x1e")
        heapq.heappush(events, (t, next(seq), "turn", conversation))
    stats = {"prompt": 0, "hit": 0, "swaps": 0, "imbalance": [], "latency": []}
    turn_rng = random.Random(cfg.seed + 1)

    def start_next(replica: SimReplica, now: float) -> None:
        if replica.busy or not replica.queue:
            return
        key, hashes, conversation, arrived, reply = replica.queue.popleft()
        hit = 0
        for h in hashes:
            if h not in replica.kv:
                break
            hit += 1
        for h in hashes:
            replica.kv.pop(h, None)
            replica.kv[h] = None
        while len(replica.kv) > cfg.kv_blocks:
            replica.kv.popitem(last=False)
        swap = 0.0
        if key.adapter:
            if key.adapter in replica.slots:
                replica.slots.move_to_end(key.adapter)
            else:
                stats["swaps"] += 1
                swap = cfg.swap_s
                replica.slots[key.adapter] = None
                while len(replica.slots) > cfg.adapter_slots:
                    replica.slots.popitem(last=False)
        prompt_tokens = len(key.content) // BYTES_PER_TOKEN
        hit_tokens = min(prompt_tokens, hit * router_config.block_bytes // BYTES_PER_TOKEN)
        stats["prompt"] += prompt_tokens
        stats["hit"] += hit_tokens
        service = (prompt_tokens - hit_tokens) * cfg.prefill_s + len(reply) / BYTES_PER_TOKEN * cfg.decode_s + swap
        replica.busy = True
        heapq.heappush(events, (now + service, next(seq), "done", (replica, conversation, arrived, reply)))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "turn":
            conversation = payload
            conversation.content.extend(b"user:" + _text(turn_rng, cfg.user_bytes) + b"\x1e")
            key = RoutingKey(bytes(conversation.content), conversation.adapter)
            hashes = block_hashes(key, router_config.block_bytes)
            replica = policy.pick(key, hashes, replicas, now)
            queues = [len(r.queue) + int(r.busy) for r in replicas]
            stats["imbalance"].append(max(queues) - min(queues))
            replica.queue.append((key, hashes, conversation, now, _text(turn_rng, cfg.reply_bytes)))
            start_next(replica, now)
        else:
            replica, conversation, arrived, reply = payload
            replica.busy = False
            policy.finished(replica)
            stats["latency"].append(now - arrived)
            conversation.content.extend(b"assistant:" + reply + b"\x1e")
            conversation.turns_left -= 1
            if conversation.turns_left > 0:
                heapq.heappush(events, (now + turn_rng.expovariate(1 / cfg.think_s), next(seq), "turn", conversation))
            start_next(replica, now)
    latency = sorted(stats["latency"])
    return Result(policy.name, cfg.num_replicas, len(latency), stats["hit"] / max(1, stats["prompt"]),
                  stats["swaps"], statistics.fmean(stats["imbalance"]), statistics.fmean(latency),
                  latency[int(0.95 * (len(latency) - 1))])
