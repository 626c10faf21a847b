"""The gateway's replicas of one service: one channel per replica address, health judged by grpc.

`--decoder` and `--pooling` take any gRPC target naming one or more replicas:

    host:port                  one replica
    ipv4:a:p,b:p  ipv6:[a]:p   a fixed list (what `tessera up --decoders N` passes)
    dns:///name:port           every address `name` resolves to: a Kubernetes headless Service
                               or a compose service name, one address per replica

The gateway scores decoder replicas itself (services/gateway/routing/), so it keeps a channel per
replica address rather than one balancing channel: a DNS target is resolved here with
`socket.getaddrinfo` every `resolve_interval_s` (replicas come and go; a replica gone is dropped,
its channel closed). Each replica's channel uses grpc's client-side health checking (service
config `healthCheckConfig`, which calls grpc.health.v1 Watch): it is READY only while the replica
says SERVING, so a replica that is loading, draining or unhealthy gets no requests. The channel
also pings the replica (`KEEPALIVE_OPTIONS`, as every `insecure_channel` does): a replica whose process
stops answering while its connection stays open (SIGSTOP, a wedged host) loses its connection within
about 8 s, as a killed one does at once: its calls end UNAVAILABLE and it is not READY until it
answers again. A replica whose channel leaves READY is forgotten by the router (a restarted
decoder's KV cache is empty).
Decoder replicas are polled with GetInfo every `info_interval_s` for the router's load figures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from services.common.server import insecure_channel

log = logging.getLogger(__name__)

# round_robin over the replica's one address, for the health checking that only LB policies other
# than pick_first apply (grpc's client-side health checking design, A17)
SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}})
DNS_PREFIXES = ("dns:///", "dns:")
# A replica that left the target (scaled down, rescheduled) keeps its channel this long, so the
# streams it is serving can finish; new requests never go to it.
LEFT_REPLICA_GRACE_S = 60.0


@dataclass(frozen=True)
class Target:
    """A parsed gRPC target: fixed `addresses`, or a DNS `host` and `port` to resolve."""

    text: str
    addresses: tuple[str, ...] = ()
    host: str = ""
    port: int = 0

    @property
    def is_dns(self) -> bool:
        return bool(self.host)


def _check_port(target: str, port: str) -> int:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target {target!r} needs a port in 1..65535, got {port!r}")
    return int(port)


def _check_host_port(target: str, address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"target {target!r}: {address!r} is not host:port")
    _check_port(target, port)
    return address


def parse_target(text: str) -> Target:
    """`host:port`, `ipv4:a:p,b:p`, `ipv6:[a]:p,...` or `dns:///name:port` (also `dns:name:port`).

    Raises:
        ValueError: an unknown scheme, an empty list, or an address without host or valid port.
    """
    for prefix in DNS_PREFIXES:
        if text.startswith(prefix):
            host, sep, port = text[len(prefix):].rpartition(":")
            if not sep or not host or "/" in host:
                raise ValueError(f"target {text!r} must be dns:///name:port")
            return Target(text, host=host, port=_check_port(text, port))
    for scheme in ("ipv4:", "ipv6:"):
        if text.startswith(scheme):
            addresses = [a for a in text[len(scheme):].split(",") if a]
            if not addresses:
                raise ValueError(f"target {text!r} lists no addresses")
            return Target(text, addresses=tuple(_check_host_port(text, a) for a in addresses))
    if "://" in text or text.startswith("unix:"):
        raise ValueError(f"target {text!r}: only host:port, ipv4:, ipv6: and dns: targets are supported")
    return Target(text, addresses=(_check_host_port(text, text),))


def resolve(target: Target) -> list[str]:
    """The replica addresses `target` names now (a DNS name looked up; an unknown name gives [])."""
    if not target.is_dns:
        return list(target.addresses)
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    addresses = []
    for family, _, _, _, sockaddr in infos:
        host = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
        address = f"{host}:{sockaddr[1]}"
        if address not in addresses:
            addresses.append(address)
    return addresses


@dataclass
class Replica:
    """One replica address with its own health-checked channel (its requests in flight are
    counted by its pool: services/gateway/pools.py)."""

    address: str
    channel: grpc.aio.Channel
    stub: object
    info: object | None = None         # last GetInfo reply (decoders), None before the first
    was_ready: bool = False
    ready_since: float = field(default_factory=time.monotonic)

    @property
    def ready(self) -> bool:
        return self.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY

    @property
    def state(self) -> str:
        return self.channel.get_state().name


class ReplicaSet:
    """The replicas of one service behind `target` (module docstring).

    `stub_class`: the service's generated stub; `poll`: optional `async (replica) -> None` run every
    `info_interval_s` on each ready replica (GetInfo for the router); `on_leave(address)`: called
    when a replica is dropped or stops being ready; `resolver`: target -> addresses (`resolve`).
    """

    def __init__(self, service: str, target: str, stub_class, poll=None,
                 on_leave: Callable[[str], None] = lambda address: None,
                 resolve_interval_s: float = 5.0, info_interval_s: float = 0.5,
                 resolver: Callable[[Target], list[str]] = resolve) -> None:
        self.service = service
        self.target = parse_target(target)
        self.stub_class = stub_class
        self.poll = poll
        self.on_leave = on_leave
        self.resolve_interval_s = resolve_interval_s
        self.info_interval_s = info_interval_s
        self.resolver = resolver
        self.replicas: dict[str, Replica] = {}
        self.ever_ready = False  # some replica has been ready since the set was made
        self._tasks: list[asyncio.Task] = []
        self._closing: set[asyncio.Task] = set()  # channels of replicas that left, in their grace period
        self._add(resolver(self.target))

    def start(self) -> None:
        """Start resolving (DNS targets) and polling on the running loop."""
        if self.target.is_dns:
            self._tasks.append(asyncio.get_running_loop().create_task(self._resolve_loop()))
        if self.poll is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._poll_loop()))

    def _add(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self.replicas:
                channel = insecure_channel(address, [("grpc.service_config", SERVICE_CONFIG)])
                self.replicas[address] = Replica(address, channel, self.stub_class(channel))
                log.info("%s replica %s joined %s", self.service, address, self.target.text)

    async def _sync(self, addresses: list[str]) -> None:
        for address in [a for a in self.replicas if a not in addresses]:
            replica = self.replicas.pop(address)
            self.on_leave(address)
            log.info("%s replica %s left %s", self.service, address, self.target.text)
            # Calls in flight may finish (a draining pod completes its streams); new ones go elsewhere.
            closing = asyncio.get_running_loop().create_task(replica.channel.close(grace=LEFT_REPLICA_GRACE_S))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        self._add(addresses)

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            addresses = await asyncio.to_thread(self.resolver, self.target)
            if addresses:  # a failed lookup keeps the last replicas: a DNS hiccup takes none away
                await self._sync(addresses)

    def ready(self) -> list[Replica]:
        """Replicas whose channel is READY (health SERVING); a replica that stopped being ready is left."""
        out = []
        for replica in self.replicas.values():
            ready = replica.ready
            if replica.was_ready and not ready:
                self.on_leave(replica.address)
                replica.info = None
            if ready and not replica.was_ready:
                replica.ready_since = time.monotonic()
            replica.was_ready = ready
            if ready:
                out.append(replica)
        self.ever_ready = self.ever_ready or bool(out)
        return out

    async def wait_ready(self, timeout_s: float) -> list[Replica]:
        """Ready replicas, waiting up to `timeout_s` for one (a channel connects lazily)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = self.ready()
            if ready or time.monotonic() >= deadline:
                return ready
            await asyncio.sleep(0.02)

    async def _poll_loop(self) -> None:
        while True:
            ready = self.ready()
            await asyncio.gather(*(self._poll_one(r) for r in ready))
            await asyncio.sleep(self.info_interval_s)

    async def _poll_one(self, replica: Replica) -> None:
        try:
            await self.poll(replica)
        except grpc.aio.AioRpcError as error:
            log.debug("%s replica %s: GetInfo failed: %s", self.service, replica.address, error.details())

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for replica in self.replicas.values():
            await replica.channel.close()
        for closing in list(self._closing):
            closing.cancel()

