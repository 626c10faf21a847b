"""Prometheus metrics over HTTP: queue depth and KV usage, the signals an autoscaler scales on.

`--metrics-port N` (decoder, pooling; 0 = off, the default) serves prometheus-client's text format
at `http://HOST:N/metrics`, HOST being the host of the service's `--address`. Gauges are read from
the running service when Prometheus scrapes (custom collectors), so serving requests costs nothing
extra. The decoder's names and meanings are vLLM's, so dashboards, alerts and autoscaling rules
written for vLLM read a tessera decoder unchanged:

    vllm:num_requests_waiting{model_name}   requests queued, not yet scheduled
    vllm:num_requests_running{model_name}   requests holding KV blocks in the running batch
    vllm:kv_cache_usage_perc{model_name}    fraction (0..1) of KV blocks held by requests;
                                            cached blocks no request holds count as free
    tessera_pooling_queue_size{model_name}  sequences accepted by a pooling model's batcher and
                                            not yet in a forward
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

DECODER_WAITING = "vllm:num_requests_waiting"
DECODER_RUNNING = "vllm:num_requests_running"
DECODER_KV_USAGE = "vllm:kv_cache_usage_perc"
POOLING_QUEUE = "tessera_pooling_queue_size"


def check_metrics_port(port: int) -> None:
    """Raises ValueError unless `port` is 0 (off) or a TCP port."""
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics_port must be 0 (off) or a TCP port in 1..65535, got {port}")


class SchedulerStats(Protocol):
    """What the decoder collector reads (services.decoder.engine.EngineStats has it)."""

    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int


class DecoderCollector(Collector):
    """vLLM's scheduler gauges for one decoder. `stats` returns None while the model is loading
    (then the gauges have no samples: an autoscaler sees no value rather than a false zero)."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats | None]):
        self.model_name, self.stats = model_name, stats

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily(DECODER_WAITING, "Requests waiting to be scheduled.", labels=["model_name"])
        running = GaugeMetricFamily(DECODER_RUNNING, "Requests in the running batch.", labels=["model_name"])
        usage = GaugeMetricFamily(DECODER_KV_USAGE, "KV-cache usage; 1 means 100 percent.", labels=["model_name"])
        stats = self.stats()
        if stats is not None:
            label = [self.model_name]
            waiting.add_metric(label, stats.num_waiting)
            running.add_metric(label, stats.num_running)
            usage.add_metric(label, 1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0)
        yield from (waiting, running, usage)


class PoolingCollector(Collector):
    """Per-model batcher queue depth; `queue_sizes` maps model name -> queued sequences."""

    def __init__(self, queue_sizes: Callable[[], dict[str, int]]):
        self.queue_sizes = queue_sizes

    def collect(self) -> Iterator[Metric]:
        queue = GaugeMetricFamily(POOLING_QUEUE, "Sequences queued for a forward, per model.", labels=["model_name"])
        for name, size in sorted(self.queue_sizes().items()):
            queue.add_metric([name], size)
        yield queue


def start_metrics_server(port: int, address: str, collector: Collector) -> WSGIServer | None:
    """Serve `collector` and the process's CPU/memory gauges on `port` (0 = off: returns None).

    `address` is the service's gRPC bind address ("host:port"); metrics bind the same host.
    The server runs on a daemon thread; `shutdown()` on the returned server stops it.

    Raises:
        OSError: the port cannot be bound.
    """
    if port == 0:
        return None
    host = address.rpartition(":")[0].strip("[]") or "0.0.0.0"
    registry = CollectorRegistry()
    registry.register(collector)
    ProcessCollector(registry=registry)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
