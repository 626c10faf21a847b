"""The decoder's request metrics under vLLM's names, fed by the engine at each lifecycle point.

The engine thread calls one hook per event; the hooks record monotonic timestamps and update
prometheus-client counters and histograms (thread-safe), which `services.common.metrics` serves.

    arrival --queue time--> first scheduled --> first token (TTFT) --ITL--> ... --> finish (e2e)

    arrival --queue--> first scheduled --prefill--> first token --decode--> last token --> finish
                       |<------------------- inference --------------------->|

As in vLLM (v1/metrics/loggers.py): TTFT is arrival to first generated token; inter-token latency
is the gap between a request's consecutive tokens; e2e latency is arrival to finish; queue time is
arrival to first scheduled; prompt tokens are counted once a request's prefill completes (its
first token), so a request aborted while waiting adds none; every finished request counts once in
`vllm:request_success_total{finished_reason}` (stop, length or abort). At finish each request is
observed once in the per-request histograms: `vllm:request_prompt_tokens` and
`vllm:request_generation_tokens` (its tokens), `vllm:request_max_num_generation_tokens` (the
max_tokens it asked, or was given), and, for the phases it reached, `vllm:request_prefill_time_seconds`,
`vllm:request_decode_time_seconds`, `vllm:request_inference_time_seconds` and
`vllm:request_time_per_output_token_seconds` (decode time over the tokens after the first). Choices
of an n > 1 request are requests of their own here. Bucket bounds are vLLM's: token counts on 1, 2,
5, 10, ... up to the context (`build_1_2_5_buckets(max_model_len)`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.metrics import DECODER_KV_USAGE, DECODER_RUNNING, DECODER_WAITING
from services.decoder.types import EngineStats

FINISH_REASONS = ("stop", "length", "abort")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
GRAMMAR_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)




def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


@dataclass
class _Timing:
    arrival_s: float
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0


@dataclass(frozen=True)
class LoraSnapshot:
    """Adapter names of the running and waiting requests at the last scheduling step."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    updated_s: float = 0.0  # wall-clock seconds (vLLM's gauge value)


class DecoderStats(Collector):
    """Counters and histograms of one decoder's requests, labelled with `model_name`.

    Hooks take engine `Request`s (key, num_prompt_tokens, lora_name, sampling.max_tokens) and a
    `SchedulerOutput` (scheduled items, preempted requests); `clock` is monotonic seconds;
    `max_model_len` (tokens) bounds the token-count buckets.
    """

    def __init__(self, model_name: str, clock=time.monotonic, max_model_len: int = 8192) -> None:
        self.model_name, self.clock = model_name, clock
        self._timings: dict[str, _Timing] = {}
        self.lora = LoraSnapshot()
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, labels + (extra or []), registry=None)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=tuple(buckets), registry=None)

        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("vllm:request_success", "Count of finished requests by finish reason.",
                                       ["finished_reason"])
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS)
        self.time_per_output_token = histogram("vllm:request_time_per_output_token_seconds",
                                               "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        tokens = token_buckets(max(1, max_model_len))
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", tokens)
        self.request_max_tokens = histogram("vllm:request_max_num_generation_tokens",
                                            "Histogram of maximum number of requested generation tokens.", tokens)
        # structured output (services/decoder/grammar.py)
        self.constrained = counter("tessera:structured_output_requests", "Requests with a structured-output "
                                   "constraint, by kind.", ["kind"])
        self.grammar_lookups = counter("tessera:structured_output_compile_cache_lookups", "Compiled-grammar cache "
                                       "lookups, by result (hit or miss).", ["result"])
        self.grammar_compile = histogram("tessera:structured_output_compile_seconds", "Histogram of structured-output "
                                         "grammar compile time in seconds (cache misses).", GRAMMAR_BUCKETS)
        self.grammar_mask = histogram("tessera:structured_output_mask_seconds", "Histogram of the time to fill a "
                                      "step's structured-output token masks in seconds.", GRAMMAR_BUCKETS)
        for result in ("hit", "miss"):
            self.grammar_lookups.labels(model_name, result)
        self._per_request = (self.prefill_time, self.decode_time, self.inference_time, self.time_per_output_token,
                             self.request_prompt_tokens, self.request_generation_tokens, self.request_max_tokens)
        for reason in FINISH_REASONS:  # present at zero from the start, as vLLM's are
            self.request_success.labels(model_name, reason)
        for metric in (self.preemptions, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
                       self.e2e, self.queue_time, *self._per_request):
            metric.labels(model_name)
        # the children `on_token` updates every token, looked up once (labels() takes a lock and a dict)
        self._generation_tokens, self._itl = self.generation_tokens.labels(model_name), self.itl.labels(model_name)

    # ---- hooks (engine thread; the grammar ones from the loop and compile threads) -------------
    def on_constrained(self, kind: str) -> None:
        self.constrained.labels(self.model_name, kind).inc()

    def on_grammar_lookup(self, hit: bool) -> None:
        self.grammar_lookups.labels(self.model_name, "hit" if hit else "miss").inc()

    def on_grammar_compile(self, seconds: float) -> None:
        self.grammar_compile.labels(self.model_name).observe(seconds)

    def on_grammar_mask(self, seconds: float) -> None:
        self.grammar_mask.labels(self.model_name).observe(seconds)

    def on_arrival(self, requests: Iterable) -> None:
        """Requests entered the waiting queue."""
        now = self.clock()
        for request in requests:
            self._timings[request.key] = _Timing(now)

    def on_schedule(self, out, scheduler) -> None:
        """A step was scheduled: first schedulings, preemptions, and the adapters in use."""
        now = self.clock()
        for item in out.scheduled:
            timing = self._timings.get(item.request.key)
            if timing is not None and timing.scheduled_s is None:
                timing.scheduled_s = now
                self.queue_time.labels(self.model_name).observe(now - timing.arrival_s)
        if out.preempted:
            self.preemptions.labels(self.model_name).inc(len(out.preempted))
        self.lora = LoraSnapshot(_names(scheduler.running), _names(scheduler.waiting), time.time())

    def on_token(self, request) -> None:
        """`request` generated one token."""
        now = self.clock()
        self._generation_tokens.inc()
        timing = self._timings.get(request.key)
        if timing is None:
            return
        if timing.last_token_s is None:
            self.ttft.labels(self.model_name).observe(now - timing.arrival_s)
            self.prompt_tokens.labels(self.model_name).inc(request.num_prompt_tokens)
            timing.first_token_s = now
        else:
            self._itl.observe(now - timing.last_token_s)
        timing.last_token_s = now
        timing.num_tokens += 1

    def on_finish(self, request, reason: str) -> None:
        """`request` left the engine with `reason` (stop, length, abort)."""
        timing = self._timings.pop(request.key, None)
        self.request_success.labels(self.model_name, reason).inc()
        if not self._timings:  # idle: no step will run to say that no adapter is in use any more
            self.lora = LoraSnapshot(updated_s=time.time())
        if timing is not None:
            self.e2e.labels(self.model_name).observe(self.clock() - timing.arrival_s)
            self._observe_request(request, timing)

    def _observe_request(self, request, timing: _Timing) -> None:
        """The per-request histograms of a finished request (the module docstring)."""
        def observe(histogram: Histogram, value: float) -> None:
            histogram.labels(self.model_name).observe(value)

        observe(self.request_prompt_tokens, request.num_prompt_tokens)
        observe(self.request_generation_tokens, timing.num_tokens)
        if request.sampling.max_tokens is not None:
            observe(self.request_max_tokens, request.sampling.max_tokens)
        if timing.scheduled_s is not None and timing.first_token_s is not None:
            observe(self.prefill_time, timing.first_token_s - timing.scheduled_s)
            observe(self.inference_time, timing.last_token_s - timing.scheduled_s)
        if timing.first_token_s is not None:
            decode_s = timing.last_token_s - timing.first_token_s
            observe(self.decode_time, decode_s)
            if timing.num_tokens > 1:
                observe(self.time_per_output_token, decode_s / (timing.num_tokens - 1))

    # ---- prometheus ------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        for metric in (self.preemptions, self.prompt_tokens, self.generation_tokens, self.request_success,
                       self.ttft, self.itl, self.e2e, self.queue_time, *self._per_request, self.constrained,
                       self.grammar_lookups, self.grammar_compile, self.grammar_mask):
            yield from metric.collect()


@dataclass(frozen=True)
class CacheInfo:
    """The KV cache's configuration, for `vllm:cache_config_info`, and the adapter slots (max_lora)."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    cache_dtype: str
    max_lora: int


class DecoderCollector(Collector):
    """Every metric of one decoder, read at scrape time from one `EngineStats` snapshot (`stats()`,
    None while the model loads: then only the scheduler gauges, without samples, so an autoscaler
    sees no value rather than a false zero) and the request metrics of `requests`:

        vllm:num_requests_waiting / _running, vllm:kv_cache_usage_perc    services/common/metrics.py
        vllm:prefix_cache_queries_total / _hits_total   prompt tokens looked up / found in the
                                                        prefix cache at admission (vLLM counts tokens)
        vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}
                                                        value: wall-clock time of the last update
        vllm:cache_config_info{block_size, num_gpu_blocks, enable_prefix_caching, cache_dtype}  1
        tessera_adapter_swaps_total                     adapters loaded into a bank slot
        tessera_adapter_host_cache_hits_total           adapter weights found in the host-memory tier
        tessera_adapter_weight_fetches_total            weight downloads from the adapter registry
    """

    def __init__(self, model_name: str, requests: DecoderStats, cache: CacheInfo,
                 stats: Callable[[], EngineStats | None]) -> None:
        self.model_name, self.requests, self.cache, self.stats = model_name, requests, cache, stats

    def collect(self) -> Iterator[Metric]:
        name, stats = self.model_name, self.stats()
        yield from _scheduler_gauges(name, stats)
        if stats is None:
            return
        yield from self.requests.collect()
        for metric, doc, value in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.",
                 stats.prefix_cache_query_tokens),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", stats.prefix_cache_hit_tokens),
                ("tessera_adapter_swaps", "Adapters written into a device slot.", stats.num_adapter_swaps),
                ("tessera_adapter_host_cache_hits", "Adapter weights found in the host-memory tier.",
                 stats.num_adapter_host_cache_hits),
                ("tessera_adapter_weight_fetches", "Adapter weight downloads from the registry.",
                 stats.num_adapter_weight_fetches)):
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([name, ",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters),
                         str(self.cache.max_lora)], stats.lora_updated_s)
        yield info
        cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache's configuration.",
                                  labels=["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching",
                                          "cache_dtype"])
        cache.add_metric([name, str(self.cache.block_size), str(self.cache.num_blocks),
                          str(self.cache.enable_prefix_caching), self.cache.cache_dtype], 1.0)
        yield cache


def _scheduler_gauges(name: str, stats: EngineStats | None) -> Iterator[Metric]:
    waiting = GaugeMetricFamily(DECODER_WAITING, "Requests waiting to be scheduled.", labels=["model_name"])
    running = GaugeMetricFamily(DECODER_RUNNING, "Requests in the running batch.", labels=["model_name"])
    usage = GaugeMetricFamily(DECODER_KV_USAGE, "KV-cache usage; 1 means 100 percent.", labels=["model_name"])
    if stats is not None:
        waiting.add_metric([name], stats.num_waiting)
        running.add_metric([name], stats.num_running)
        usage.add_metric([name], 1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0)
    yield from (waiting, running, usage)


def _names(requests: Iterable) -> tuple[str, ...]:
    return tuple(sorted({r.lora_name for r in requests if r.lora_name}))
