"""Decoder and pooler replicas behind the gateway: the replica set (I/O) joined to its policy.

`DecoderPool` routes each Generate with the router's score (services/gateway/router.py) and keeps
the router's load figures current from GetInfo; `PoolerPool` sends each pooling call to the
ready pooler with the fewest requests in flight. Both wait briefly for a first ready replica
(channels connect lazily) and then raise `Unavailable` naming the target and each replica's state.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from services.common.errors import Unavailable
from services.gateway.replicas import Replica, ReplicaSet
from services.gateway.router import LeastOutstanding, Router, RouterConfig, RoutingKey
from tessera.v1 import decoder_pb2, decoder_pb2_grpc, gateway_pb2, pooling_pb2_grpc

READY_WAIT_S = 3.0  # how long a request waits for some replica to become ready


class _Pool:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    async def ready(self, exclude: Collection[str], remaining: float | None) -> list[Replica]:
        wait = READY_WAIT_S if remaining is None else max(0.0, min(READY_WAIT_S, remaining))
        ready = [r for r in await self.replicas.wait_ready(wait) if r.address not in exclude]
        if not ready:
            states = ", ".join(f"{r.address} {r.state}" for r in self.replicas.replicas.values()) or "none resolved"
            tried = f"; tried {', '.join(exclude)}" if exclude else ""
            raise Unavailable(f"no {self.replicas.service} replica is ready behind {self.replicas.target.text} "
                              f"(replicas: {states}){tried}")
        return ready

    def started(self, replica: Replica) -> None:
        replica.num_requests += 1
        replica.num_outstanding += 1

    def finished(self, replica: Replica) -> None:
        replica.num_outstanding -= 1

    def info(self) -> list[gateway_pb2.ReplicaInfo]:
        out = []
        for replica in self.replicas.replicas.values():
            item = gateway_pb2.ReplicaInfo(
                service=self.replicas.service, address=replica.address, ready=replica.ready, state=replica.state,
                num_requests=replica.num_requests, num_outstanding=replica.num_outstanding)
            if isinstance(replica.info, decoder_pb2.DecoderInfo):
                item.decoder.CopyFrom(replica.info)
            out.append(item)
        return out

    def start(self) -> None:
        self.replicas.start()

    async def close(self) -> None:
        await self.replicas.close()


class DecoderPool(_Pool):
    """Decoder replicas behind `target`, scored per request by a `Router`."""

    def __init__(self, target: str, config: RouterConfig | None = None, info_interval_s: float = 0.5) -> None:
        self.router = Router(config)
        super().__init__(ReplicaSet("decoder", target, decoder_pb2_grpc.DecoderStub, poll=self._poll,
                                    on_leave=self.router.remove, info_interval_s=info_interval_s))

    async def pick(self, key: RoutingKey, exclude: Collection[str] = (), remaining: float | None = None) -> Replica:
        """The replica to run `key` on, among ready ones not in `exclude`; recorded as started.

        Raises:
            Unavailable: no such replica became ready within READY_WAIT_S (or `remaining`).
        """
        ready = {r.address: r for r in await self.ready(exclude, remaining)}
        decision = self.router.pick(key, list(ready), time.monotonic())
        replica = ready[decision.replica]
        self.started(replica)
        return replica

    async def pick_unary(self, remaining: float | None = None) -> Replica:
        """The ready replica with the fewest requests in flight, for a unary call; recorded as started."""
        replica = min(await self.ready((), remaining), key=lambda r: r.num_outstanding)
        self.started(replica)
        return replica

    def started(self, replica: Replica) -> None:
        super().started(replica)
        self.router.started(replica.address)

    def finished(self, replica: Replica) -> None:
        super().finished(replica)
        self.router.finished(replica.address)

    async def _poll(self, replica: Replica) -> None:
        outstanding = replica.num_outstanding
        timeout = max(1.0, self.replicas.info_interval_s)
        info = await replica.stub.GetInfo(decoder_pb2.DecoderInfoRequest(), timeout=timeout)
        replica.info = info
        kv_usage = 1.0 - info.num_free_blocks / info.num_blocks if info.num_blocks else 0.0
        self.router.set_report(replica.address, info.num_running, info.num_waiting, kv_usage,
                               info.resident_adapters, outstanding)


class PoolerPool(_Pool):
    """Pooling replicas behind `target`: least outstanding requests, round robin among ties."""

    def __init__(self, target: str) -> None:
        self.policy = LeastOutstanding()
        super().__init__(ReplicaSet("pooling", target, pooling_pb2_grpc.PoolingStub))

    async def pick(self, exclude: Collection[str] = (), remaining: float | None = None) -> Replica:
        """Raises: Unavailable, as `DecoderPool.pick`."""
        ready = {r.address: r for r in await self.ready(exclude, remaining)}
        replica = ready[self.policy.pick(list(ready))]
        self.started(replica)
        return replica

    def started(self, replica: Replica) -> None:
        super().started(replica)
        self.policy.started(replica.address)

    def finished(self, replica: Replica) -> None:
        super().finished(replica)
        self.policy.finished(replica.address)
