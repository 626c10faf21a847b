"""A pooling model's batching metrics, TEI's concepts under a `tessera_pooling_` prefix.

`DynamicBatcher` calls one hook per event (monotonic seconds; all on its event loop's thread):

    tessera_pooling_batch_size                       sequences per forward (TEI te_batch_next_size)
    tessera_pooling_batch_tokens                     real (unpadded) tokens per forward (te_batch_next_tokens)
    tessera_pooling_request_queue_duration_seconds   a sequence's wait from submit to its forward
                                                     (te_request_queue_duration)
    tessera_pooling_batch_inference_duration_seconds one forward (te_batch_inference_duration)
    tessera_pooling_request_duration_seconds         a request's submit to all of its rows
                                                     (te_request_duration, batcher part)

Each is labelled with `model_name`. With `--no-dynamic-batching` none is recorded (there is no
queue or shared batch to describe).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from prometheus_client import Histogram
from prometheus_client.core import Metric

# powers of two, as TEI's size histograms; seconds from 1 ms up
SIZE_BUCKETS = tuple(float(2 ** i) for i in range(0, 13))
TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(4, 19))
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class BatcherStats:
    """Histograms of one model's batcher (see the module docstring)."""

    def __init__(self, model_name: str, clock=time.monotonic) -> None:
        self.model_name, self.clock = model_name, clock
        self._forward_started: float | None = None

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=None)

        self.batch_size = histogram("tessera_pooling_batch_size", "Sequences per forward.", SIZE_BUCKETS)
        self.batch_tokens = histogram("tessera_pooling_batch_tokens", "Tokens per forward (unpadded).",
                                      TOKEN_BUCKETS)
        self.queue_duration = histogram("tessera_pooling_request_queue_duration_seconds",
                                        "Seconds a sequence waited for its forward.", SECONDS_BUCKETS)
        self.inference_duration = histogram("tessera_pooling_batch_inference_duration_seconds",
                                            "Seconds of one forward.", SECONDS_BUCKETS)
        self.request_duration = histogram("tessera_pooling_request_duration_seconds",
                                          "Seconds from a request's submit to all of its rows.", SECONDS_BUCKETS)
        self.metrics = (self.batch_size, self.batch_tokens, self.queue_duration, self.inference_duration,
                        self.request_duration)
        for metric in self.metrics:
            metric.labels(model_name)

    def on_batch(self, batch: Sequence) -> None:
        """A forward starts over `batch` (items with `.sequence` and `.arrival_s`)."""
        now = self.clock()
        self._forward_started = now
        self.batch_size.labels(self.model_name).observe(len(batch))
        self.batch_tokens.labels(self.model_name).observe(sum(len(item.sequence) for item in batch))
        for item in batch:
            self.queue_duration.labels(self.model_name).observe(now - item.arrival_s)

    def on_forward_end(self) -> None:
        """The forward `on_batch` announced returned its rows."""
        if self._forward_started is not None:
            self.inference_duration.labels(self.model_name).observe(self.clock() - self._forward_started)
            self._forward_started = None

    def on_request_done(self, submitted_s: float) -> None:
        """A request submitted at `submitted_s` has every row."""
        self.request_duration.labels(self.model_name).observe(self.clock() - submitted_s)

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            yield from metric.collect()
