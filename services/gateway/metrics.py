"""The gateway's Prometheus metrics: its calls to each downstream and its replicas' state.

    tessera_gateway_downstream_requests_total{service, replica, method, code}
    tessera_gateway_downstream_request_duration_seconds{service, replica, method}   histogram
    tessera_gateway_replica_up{service, replica}            1 while the replica's channel is READY
                                                            (its health says SERVING), else 0
    tessera_gateway_replica_outstanding_requests{service, replica}   requests in flight there

The downstream metrics come from an interceptor on every channel the gateway opens
(`services.common.metrics.record_downstream`, enabled in `__main__` before the core is built).
They are served on the gateway's HTTP port at /metrics (mount `asgi_app(core)` there) and,
with `--metrics-port N`, on a port of their own like every other service's.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry, make_asgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.metrics import make_registry, record_downstream

REPLICA_UP = "tessera_gateway_replica_up"
REPLICA_OUTSTANDING = "tessera_gateway_replica_outstanding_requests"


class ReplicaCollector(Collector):
    """Replica state of the core's decoder and pooler pools, read when Prometheus scrapes."""

    def __init__(self, core) -> None:
        self.core = core

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(REPLICA_UP, "1 while the replica is ready (health SERVING).",
                               labels=["service", "replica"])
        outstanding = GaugeMetricFamily(REPLICA_OUTSTANDING, "Requests the gateway has in flight at the replica.",
                                        labels=["service", "replica"])
        for pool in (self.core.decoders, self.core.poolers):
            service = pool.replicas.service
            for replica in list(pool.replicas.replicas.values()):
                ready = replica.channel.get_state() == grpc.ChannelConnectivity.READY
                up.add_metric([service, replica.address], float(ready))
                outstanding.add_metric([service, replica.address], pool.in_flight[replica.address])
        yield up
        yield outstanding


def collectors(core) -> list[Collector]:
    """The gateway's collectors: downstream calls (enables their recording) and `core`'s replicas."""
    return [record_downstream(), ReplicaCollector(core)]


def registry(core) -> CollectorRegistry:
    """The gateway's metrics (downstream calls, replicas, process) in a registry of their own."""
    return make_registry(*collectors(core))


def asgi_app(core):
    """An ASGI app answering GET with the Prometheus text of `registry(core)`.

    FastAPI/Starlette: `app.mount("/metrics", asgi_app(core))` serves `/metrics/` (and
    redirects `/metrics` there, which Prometheus follows); for `/metrics` itself add a route that
    returns `Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)` with `reg =
    registry(core)` (prometheus_client). Either way `record_downstream()` must have run before
    the core opened its channels (`python -m services.gateway` does so first)."""
    return make_asgi_app(registry(core))
