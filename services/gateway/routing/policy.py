"""The routing policy interface and the one count of requests in flight.

As SGLang's router: one policy interface (`RoutingPolicy`), one file per policy
(cache_aware.py, least_outstanding.py), a factory (factory.py). Every policy reads the gateway's
requests in flight from one `InFlight`, owned by the replica pool that routes the requests
(services/gateway/pools.py), which counts each routed request from its pick to its end, streams
and unary calls alike; a policy never changes the counts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingKey:
    """What a Generate request's KV blocks depend on, as the gateway sees it.

    `content`: canonical UTF-8 bytes of the prompt (services/gateway/convert.py renders it);
    `adapter`: the adapter name ("" = base model); `image_offsets`: (byte offset in `content`,
    content hash) of each image.
    """

    content: bytes
    adapter: str = ""
    image_offsets: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class Decision:
    """The replica a policy picked; what prefix and adapter affinity found there (0 / False for a
    policy that does not look)."""

    replica: str
    matched_blocks: int = 0
    num_blocks: int = 0
    adapter_resident: bool = False


@dataclass(frozen=True)
class ReplicaReport:
    """A decoder replica's own report (GetInfo). `num_in_flight_then`: the gateway's requests in
    flight there when the report was asked for (None: the count now); the rest of its running and
    waiting requests are other clients' (other gateways')."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0              # fraction of KV blocks in use, 0..1
    resident_adapters: Collection[str] = ()
    num_in_flight_then: int | None = None


class InFlight:
    """The gateway's requests per replica address: in flight now, and routed there in all."""

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._routed: dict[str, int] = {}

    def __getitem__(self, replica: str) -> int:
        """Requests in flight at `replica` now (0 for one never routed to)."""
        return self._in_flight.get(replica, 0)

    def num_requests(self, replica: str) -> int:
        """Requests routed to `replica` since the gateway started."""
        return self._routed.get(replica, 0)

    def started(self, replica: str) -> None:
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1
        self._routed[replica] = self._routed.get(replica, 0) + 1

    def finished(self, replica: str) -> None:
        self._in_flight[replica] = max(0, self._in_flight.get(replica, 0) - 1)


class RoutingPolicy(ABC):
    """Chooses one ready replica per request.

    Contract: `pick(key, ready, now)` returns a `Decision` naming one of `ready` (None when `ready`
    is empty) and may learn from it (a prefix index); it reads load from `in_flight` and never
    changes it: the caller counts the request started at the replica picked and finished when it
    ends. `now` is seconds on the caller's monotonic clock; `key` is the request's RoutingKey, or
    None for a call with no prompt to be affine to (a unary call, a pooling call). `report` takes a
    replica's own report and `remove` forgets a replica that left or restarted; both are no-ops for
    a policy that keeps nothing per replica.
    """

    def __init__(self, in_flight: InFlight | None = None) -> None:
        self.in_flight = in_flight if in_flight is not None else InFlight()

    @abstractmethod
    def pick(self, key: RoutingKey | None, ready: Sequence[str], now: float = 0.0) -> Decision | None:
        ...

    def report(self, replica: str, report: ReplicaReport) -> None:  # noqa: B027 - optional for a policy
        """Take `replica`'s own report of its load."""

    def remove(self, replica: str) -> None:  # noqa: B027 - optional for a policy
        """Forget what is known of `replica` (its in-flight requests are still counted until they end)."""
