"""Prometheus metrics over HTTP: the pieces every service shares.

`--metrics-port N` (every service; 0 = off, the default) serves prometheus-client's text format at
`http://HOST:N/metrics`, HOST being the host of the service's `--address`, from a registry of the
service's own (`make_registry`). Gauges are read from the running service when Prometheus scrapes
(custom collectors); request metrics come from each service's stats object (services/decoder/
stats.py, services/pooling/stats.py, services/vision/stats.py) and, for the gateway, from the
downstream-call interceptors below (services/gateway/metrics.py). The decoder's names and meanings
are vLLM's, so dashboards, alerts and autoscaling rules written for vLLM read a tessera decoder
unchanged; the scheduler gauges (services/decoder/stats.py `DecoderCollector` serves them, with the
rest of the decoder's families):

    vllm:num_requests_waiting{model_name}   requests queued, not yet scheduled
    vllm:num_requests_running{model_name}   requests holding KV blocks in the running batch
    vllm:kv_cache_usage_perc{model_name}    fraction (0..1) of KV blocks held by requests;
                                            cached blocks no request holds count as free
    tessera_pooling_queue_size{model_name}  sequences accepted by a pooling model's batcher and
                                            not yet in a forward
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from services.common.interceptors import client_interceptors

DECODER_WAITING = "vllm:num_requests_waiting"
DECODER_RUNNING = "vllm:num_requests_running"
DECODER_KV_USAGE = "vllm:kv_cache_usage_perc"
POOLING_QUEUE = "tessera_pooling_queue_size"


def check_metrics_port(port: int) -> None:
    """Raises ValueError unless `port` is 0 (off) or a TCP port."""
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics_port must be 0 (off) or a TCP port in 1..65535, got {port}")


class PoolingCollector(Collector):
    """Per-model batcher queue depth; `queue_sizes` maps model name -> queued sequences."""

    def __init__(self, queue_sizes: Callable[[], dict[str, int]]):
        self.queue_sizes = queue_sizes

    def collect(self) -> Iterator[Metric]:
        queue = GaugeMetricFamily(POOLING_QUEUE, "Sequences queued for a forward, per model.", labels=["model_name"])
        for name, size in sorted(self.queue_sizes().items()):
            queue.add_metric([name], size)
        yield queue


class MergedCollector(Collector):
    """The families of every collector `sources()` returns now, merged by name (one family per
    name, as the text format requires, when several models each keep their own metrics)."""

    def __init__(self, sources: Callable[[], Iterable[Collector]]):
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for source in self.sources():
            for family in source.collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()


def make_registry(*collectors: Collector) -> CollectorRegistry:
    """A registry of `collectors` and the process's own series, as prometheus_client's default
    registry holds them: CPU, memory and file descriptors (`process_*`), the interpreter
    (`python_info`) and its garbage collector (`python_gc_*`). Not the global registry, so
    in-process tests and several services in one process never share samples."""
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def start_metrics_server(port: int, address: str, *collectors: Collector) -> WSGIServer | None:
    """Serve `collectors` and the process's CPU/memory gauges on `port` (0 = off: returns None).

    `address` is the service's gRPC bind address ("host:port"); metrics bind the same host.
    The server runs on a daemon thread; `shutdown()` on the returned server stops it.

    Raises:
        OSError: the port cannot be bound; its message names the address and the flag.
    """
    if port == 0:
        return None
    host = address.rpartition(":")[0].strip("[]") or "0.0.0.0"
    try:
        server, _ = start_http_server(port, addr=host, registry=make_registry(*collectors))
    except OSError as error:
        refused = OSError(f"cannot serve /metrics on {host}:{port} (--metrics-port): {error.strerror or error}")
        refused.errno = error.errno
        raise refused from None
    return server


# ---- calls to other services (the gateway's downstreams) ------------------------------------

DOWNSTREAM_REQUESTS = "tessera_gateway_downstream_requests"
DOWNSTREAM_SECONDS = "tessera_gateway_downstream_request_duration_seconds"
DOWNSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class DownstreamMetrics:
    """Per-downstream call counts by status and call durations (first message sent to status
    received; a stream's whole life), labelled `service` (from the method path: `decoder`,
    `pooling`, ...), `replica` (the channel's address), `method` and, for counts, `code`."""

    def __init__(self) -> None:
        self.requests = Counter(DOWNSTREAM_REQUESTS, "Calls to other services by final status.",
                                ["service", "replica", "method", "code"], registry=None)
        self.seconds = Histogram(DOWNSTREAM_SECONDS, "Seconds of calls to other services.",
                                 ["service", "replica", "method"], buckets=DOWNSTREAM_BUCKETS, registry=None)
        self._pending: set[asyncio.Task] = set()

    def interceptors(self, address: str) -> list[grpc.aio.ClientInterceptor]:
        """Interceptors recording every call on a channel to `address`."""
        async def intercept(continuation, details, request):
            started = time.monotonic()
            call = await continuation(details, request)
            method = details.method.decode() if isinstance(details.method, bytes) else details.method
            task = asyncio.ensure_future(self.record(call, address, method, started))
            self._pending.add(task)  # a reference until it is done (the loop keeps only weak ones)
            task.add_done_callback(self._pending.discard)
            return call

        return client_interceptors(intercept)

    async def record(self, call, address: str, method: str, started: float) -> None:
        service, _, name = method.strip("/").rpartition("/")
        service = service.rpartition(".")[2].lower()
        try:
            code = (await call.code()).name
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED.name
        self.requests.labels(service, address, name, code).inc()
        self.seconds.labels(service, address, name).observe(time.monotonic() - started)

    def collect(self) -> Iterator[Metric]:
        yield from self.requests.collect()
        yield from self.seconds.collect()


_downstream: DownstreamMetrics | None = None


def record_downstream() -> DownstreamMetrics:
    """Count and time every call this process's `server.insecure_channel`s make from now on
    (channels opened later; the gateway calls this before building its servicer)."""
    global _downstream
    if _downstream is None:
        _downstream = DownstreamMetrics()
    return _downstream


def downstream_interceptors(address: str) -> list[grpc.aio.ClientInterceptor]:
    """The downstream-metrics interceptors for a channel to `address`, once `record_downstream()` ran."""
    return [] if _downstream is None else _downstream.interceptors(address)
