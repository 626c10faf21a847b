"""Decoder and pooler replicas behind the gateway: the replica set (I/O) joined to its routing policy.

Each pool owns the one count of the gateway's requests in flight at its replicas
(routing.InFlight): `pick` counts a request started at the replica its policy chose, `finished`
counts it ended, whatever kind of call it is. `DecoderPool` routes each Generate with the
cache-aware policy (routing/cache_aware.py: prefix affinity, adapter affinity, load) and keeps its
load figures current from GetInfo, and unary decoder calls with the least-outstanding policy over
the same counts; `PoolerPool` sends each pooling call to the ready pooler with the fewest requests
in flight. Both wait briefly for a first ready replica (channels connect lazily) and then raise
`Unavailable` naming the target and each replica's state.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from services.common.errors import Unavailable
from services.gateway.replicas import Replica, ReplicaSet
from services.gateway.routing import InFlight, ReplicaReport, RouterConfig, RoutingKey, RoutingPolicy, create_policy
from tessera.v1 import decoder_pb2, decoder_pb2_grpc, gateway_pb2, pooling_pb2_grpc

READY_WAIT_S = 3.0  # how long a request waits for some replica to become ready


class _Pool:
    """`replicas` routed by `policy`, whose InFlight is the pool's count of requests in flight."""

    def __init__(self, replicas: ReplicaSet, policy: RoutingPolicy) -> None:
        self.replicas = replicas
        self.policy = policy
        self.in_flight: InFlight = policy.in_flight

    async def ready(self, exclude: Collection[str], remaining: float | None) -> list[Replica]:
        wait = READY_WAIT_S if remaining is None else max(0.0, min(READY_WAIT_S, remaining))
        ready = [r for r in await self.replicas.wait_ready(wait) if r.address not in exclude]
        if not ready:
            states = ", ".join(f"{r.address} {r.state}" for r in self.replicas.replicas.values()) or "none resolved"
            tried = f"; tried {', '.join(exclude)}" if exclude else ""
            raise Unavailable(f"no {self.replicas.service} replica is ready behind {self.replicas.target.text} "
                              f"(replicas: {states}){tried}")
        return ready

    async def pick(self, key: RoutingKey | None = None, exclude: Collection[str] = (), remaining: float | None = None,
                   policy: RoutingPolicy | None = None) -> Replica:
        """The replica `policy` (default: the pool's) picks for `key` among ready ones not in
        `exclude`, counted as started there: the caller calls `finished` when the request ends.

        Raises:
            Unavailable: no such replica became ready within READY_WAIT_S (or `remaining`).
        """
        ready = {r.address: r for r in await self.ready(exclude, remaining)}
        decision = (policy or self.policy).pick(key, list(ready), time.monotonic())
        self.in_flight.started(decision.replica)
        return ready[decision.replica]

    def finished(self, replica: Replica) -> None:
        self.in_flight.finished(replica.address)

    def info(self) -> list[gateway_pb2.ReplicaInfo]:
        out = []
        for replica in self.replicas.replicas.values():
            item = gateway_pb2.ReplicaInfo(
                service=self.replicas.service, address=replica.address, ready=replica.ready, state=replica.state,
                num_requests=self.in_flight.num_requests(replica.address),
                num_outstanding=self.in_flight[replica.address])
            if isinstance(replica.info, decoder_pb2.DecoderInfo):
                item.decoder.CopyFrom(replica.info)
            out.append(item)
        return out

    def start(self) -> None:
        self.replicas.start()

    async def close(self) -> None:
        await self.replicas.close()


class DecoderPool(_Pool):
    """Decoder replicas behind `target`: Generate by the cache-aware policy, unary calls by the
    least-outstanding one, over one count of requests in flight."""

    def __init__(self, target: str, config: RouterConfig | None = None, info_interval_s: float = 0.5) -> None:
        in_flight = InFlight()
        policy = create_policy("cache_aware", in_flight, config)
        self.unary_policy = create_policy("least_outstanding", in_flight)
        super().__init__(ReplicaSet("decoder", target, decoder_pb2_grpc.DecoderStub, poll=self._poll,
                                    on_leave=policy.remove, info_interval_s=info_interval_s), policy)

    async def pick_unary(self, remaining: float | None = None) -> Replica:
        """The replica for a unary call (Tokenize, Detokenize); raises Unavailable as `pick`."""
        return await self.pick(None, (), remaining, self.unary_policy)

    async def _poll(self, replica: Replica) -> None:
        in_flight_then = self.in_flight[replica.address]
        timeout = max(1.0, self.replicas.info_interval_s)
        info = await replica.stub.GetInfo(decoder_pb2.DecoderInfoRequest(), timeout=timeout)
        replica.info = info
        kv_usage = 1.0 - info.num_free_blocks / info.num_blocks if info.num_blocks else 0.0
        self.policy.report(replica.address, ReplicaReport(info.num_running, info.num_waiting, kv_usage,
                                                          info.resident_adapters, in_flight_then))


class PoolerPool(_Pool):
    """Pooling replicas behind `target`: least outstanding requests, round robin among ties."""

    def __init__(self, target: str) -> None:
        super().__init__(ReplicaSet("pooling", target, pooling_pb2_grpc.PoolingStub),
                         create_policy("least_outstanding"))
