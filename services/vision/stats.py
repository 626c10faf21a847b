"""The vision service's metrics: encoder cache effectiveness and encoder time.

    tessera_vision_encoder_cache_hits_total       images whose rows came from the encoder cache
    tessera_vision_encoder_cache_misses_total     images looked up and not found (then encoded)
    tessera_vision_encoder_cache_evictions_total  entries evicted to make room
    tessera_vision_encoder_cache_bytes            bytes of cached rows now (gauge; capacity in
                                                  tessera_vision_encoder_cache_capacity_bytes)
    tessera_vision_images_encoded_total           images that ran through the encoder
    tessera_vision_encode_seconds                 histogram: one encoder forward over a request's
                                                  distinct cache misses

Each is labelled with `model_name`, the encoder's name. Counters are read from the engine's
`EncoderCache` when Prometheus scrapes; the histogram is fed by `VisionStats.timed`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

T = TypeVar("T")
ENCODE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class VisionStats:
    """The encode-time histogram of one vision engine, whose encoder is `model_name`."""

    def __init__(self, model_name: str, clock=time.monotonic) -> None:
        self.clock = clock
        histogram = Histogram("tessera_vision_encode_seconds", "Seconds of one encoder forward.",
                              ["model_name"], buckets=ENCODE_BUCKETS, registry=None)
        self.encode_seconds = histogram
        self._observe = histogram.labels(model_name).observe  # the series exists, at zero, from the start

    def timed(self, encode: Callable[..., T], *args) -> T:
        """`encode(*args)`, its seconds observed (not when it raises)."""
        started = self.clock()
        result = encode(*args)
        self._observe(self.clock() - started)
        return result


class VisionCollector(Collector):
    """Reads the engine `engine()` returns (None while it loads: no samples)."""

    def __init__(self, engine: Callable[[], object | None]) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine()
        if engine is None:
            return
        name, cache = engine.encoder.name, engine.cache.stats()
        for metric, doc, value in (
                ("tessera_vision_encoder_cache_hits", "Images served from the encoder cache.", cache.hits),
                ("tessera_vision_encoder_cache_misses", "Encoder cache lookups that missed.", cache.misses),
                ("tessera_vision_encoder_cache_evictions", "Encoder cache entries evicted.", cache.evictions),
                ("tessera_vision_images_encoded", "Images run through the encoder.", engine.images_encoded)):
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        for metric, doc, value in (
                ("tessera_vision_encoder_cache_bytes", "Bytes of cached encoder rows.", cache.bytes),
                ("tessera_vision_encoder_cache_capacity_bytes", "Encoder cache capacity in bytes.",
                 cache.capacity_bytes)):
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        yield from engine.stats.encode_seconds.collect()
