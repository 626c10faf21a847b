"""The gateway's Prometheus metrics: its calls to each downstream, its replicas' state, and on the
HTTP API port every decoder replica's own vLLM series.

    tessera_gateway_downstream_requests_total{service, replica, method, code}
    tessera_gateway_downstream_request_duration_seconds{service, replica, method}   histogram
    tessera_gateway_replica_up{service, replica}            1 while the replica's channel is READY
                                                            (its health says SERVING), else 0
    tessera_gateway_replica_outstanding_requests{service, replica}   requests in flight there

The downstream metrics come from an interceptor on every channel the gateway opens
(`services.common.metrics.record_downstream`, enabled in `__main__` before the core is built).
`--metrics-port N` serves these, the gateway's own, on a port of their own like every other
service's. The HTTP API port's /metrics (`asgi_app(core)`) serves them too, and with them every
decoder replica's `vllm:*` series, as vLLM's production-stack router serves its engines' stats
behind its one endpoint: on each scrape the gateway asks every ready decoder replica for its
metrics (Decoder.GetMetrics, all at once, each within SCRAPE_TIMEOUT_S) and relays its vllm:*
families with a `replica` label (its address) added, so one scrape of the public endpoint fills
vLLM's dashboards; `sum by (le)` / `sum` over `replica` gives the cluster. A replica that is not
ready, fails or is slower than the timeout is skipped in that scrape and counted:

    tessera_gateway_replica_metrics_up{service, replica}    1 when this scrape holds the replica's
                                                            series, 0 when it was skipped
    tessera_gateway_replica_metrics_skipped_total{service, replica}   scrapes that skipped it

Scrape either the API port's /metrics or the replicas' own ports with the gateway's metrics port,
never both into one Prometheus: the relayed series would count every request twice
(docs/operations.md#metrics).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from services.common.metrics import make_registry, record_downstream
from tessera.v1 import decoder_pb2

REPLICA_UP = "tessera_gateway_replica_up"
REPLICA_OUTSTANDING = "tessera_gateway_replica_outstanding_requests"
REPLICA_METRICS_UP = "tessera_gateway_replica_metrics_up"
REPLICA_METRICS_SKIPPED = "tessera_gateway_replica_metrics_skipped"
RELAYED_PREFIX = "vllm:"  # the replicas' families the API port's /metrics relays
REPLICA_LABEL = "replica"
SCRAPE_TIMEOUT_S = 2.0  # the longest a scrape waits for one replica's metrics


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


class ReplicaMetrics:
    """Every decoder replica's vLLM families, asked on each scrape (the module docstring).

    `pool`: the core's DecoderPool; `timeout_s`: the longest wait for one replica (seconds).
    """

    def __init__(self, pool, timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self.pool, self.timeout_s = pool, timeout_s
        self.skipped = Counter(REPLICA_METRICS_SKIPPED, "Scrapes of the gateway's /metrics that skipped the replica "
                               "(not ready, failed or timed out).", ["service", "replica"], registry=None)

    async def collect(self) -> list[Metric]:
        """The relayed families, each sample labelled with its replica, and the replicas' scrape state."""
        service = self.pool.replicas.service
        replicas = list(self.pool.replicas.replicas.values())
        ready = {r.address for r in self.pool.replicas.ready()}
        texts = await asyncio.gather(*(self._ask(r) for r in replicas if r.address in ready))
        text_of = dict(zip([r.address for r in replicas if r.address in ready], texts))
        up = GaugeMetricFamily(REPLICA_METRICS_UP, "1 when this scrape holds the replica's series, 0 when it was "
                               "skipped.", labels=["service", "replica"])
        merged: dict[str, Metric] = {}
        for replica in replicas:
            text = text_of.get(replica.address)
            up.add_metric([service, replica.address], float(text is not None))
            if text is None:
                self.skipped.labels(service, replica.address).inc()
                continue
            for family in _relayed(text):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                into.samples.extend(Sample(s.name, {**s.labels, REPLICA_LABEL: replica.address}, s.value, s.timestamp,
                                           s.exemplar) for s in family.samples)
        return [*merged.values(), up, *self.skipped.collect()]

    async def _ask(self, replica) -> str | None:
        try:
            reply = await replica.stub.GetMetrics(decoder_pb2.MetricsRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError:
            return None
        return reply.text


def _relayed(text: str) -> Iterator[Metric]:
    """The vllm:* families of one replica's exposition (prometheus_client's `_created` series left out)."""
    for family in text_string_to_metric_families(text):
        if family.name.startswith(RELAYED_PREFIX) and not family.name.endswith("_created"):
            yield family


class _Families:
    """Families as a registry for `generate_latest`."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def collectors(core) -> list[Collector]:
    """The gateway's collectors: downstream calls (enables their recording) and `core`'s replicas."""
    return [record_downstream(), ReplicaCollector(core)]


def registry(core) -> CollectorRegistry:
    """The gateway's metrics (downstream calls, replicas, process) in a registry of their own."""
    return make_registry(*collectors(core))


def asgi_app(core, timeout_s: float = SCRAPE_TIMEOUT_S):
    """An ASGI app answering each request with the Prometheus text of `registry(core)` followed by
    every decoder replica's relayed vLLM series (`ReplicaMetrics`), for the HTTP API port's /metrics.
    `record_downstream()` must have run before the core opened its channels (`python -m
    services.gateway` does so first)."""
    own = registry(core)
    replicas = ReplicaMetrics(core.decoders, timeout_s)

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = generate_latest(own) + generate_latest(_Families(await replicas.collect()))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app
