"""Prometheus /metrics of real decoder and pooling processes, parsed as Prometheus parses them."""

from __future__ import annotations

import asyncio
import io
import random
import threading
import time
import urllib.request

import grpc
import pytest
from PIL import Image
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.adapters import __main__ as adapters_main
from services.common.launch import free_port
from services.common.metrics import (
    DECODER_KV_USAGE,
    DECODER_RUNNING,
    DECODER_WAITING,
    POOLING_QUEUE,
    make_registry,
)
from services.common.tensor import from_pb
from services.decoder.config import DecoderConfig
from services.decoder.stats import CacheInfo, DecoderCollector, DecoderStats
from services.decoder.types import EngineStats
from services.gateway import __main__ as gateway_main
from services.gateway.config import GatewayConfig
from services.pooling import __main__ as pooling_main
from services.vision import __main__ as vision_main
from services.vision.config import VisionConfig
from services.vision.core import VisionCore
from services.vision.encoder import DemoEncoderConfig
from services.vision.processor import ImageSource
from services.vision.stats import VisionCollector
from tessera.v1 import decoder_pb2, decoder_pb2_grpc, gateway_pb2_grpc, pooling_pb2, pooling_pb2_grpc
from tests.deploy.prom import Samples


def scrape(url: str) -> dict[str, dict[str, float]]:
    """metric name -> {model_name label: value}."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {family.name: {s.labels.get("model_name", ""): s.value for s in family.samples}
            for family in text_string_to_metric_families(text)}


def samples(url: str) -> Samples:
    return Samples.parse(urllib.request.urlopen(url, timeout=5).read().decode())


def test_decoder_gauges_follow_the_scheduler(decoder_service):
    idle = scrape(decoder_service.metrics_url)
    assert idle[DECODER_WAITING] == {"smollm2-135m-instruct": 0.0}
    assert idle[DECODER_RUNNING] == {"smollm2-135m-instruct": 0.0}
    assert idle[DECODER_KV_USAGE] == {"smollm2-135m-instruct": 0.0}
    assert "process_resident_memory_bytes" in idle

    request = decoder_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3, 4, 5], sampling=decoder_pb2.SamplingParams(
        max_tokens=500, ignore_eos=True))
    with grpc.insecure_channel(decoder_service.address) as channel:
        stub = decoder_pb2_grpc.DecoderStub(channel)
        streams = [stub.Generate(request, timeout=120)]
        next(streams[0])  # running: it holds the one batch slot for 500 tokens
        streams += [stub.Generate(request, timeout=120) for _ in range(2)]
        seen = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the two other requests reach the engine's queue asynchronously
            seen = scrape(decoder_service.metrics_url)
            if seen[DECODER_WAITING]["smollm2-135m-instruct"] == 2:
                break
            time.sleep(0.05)
        for stream in streams:
            stream.cancel()
    assert seen[DECODER_WAITING] == {"smollm2-135m-instruct": 2.0}  # --max-num-seqs 1: one runs, two wait
    assert seen[DECODER_RUNNING] == {"smollm2-135m-instruct": 1.0}
    assert 0.0 < seen[DECODER_KV_USAGE]["smollm2-135m-instruct"] <= 1.0


def test_pooling_queue_gauge_counts_queued_sequences(pooling_service):
    assert scrape(pooling_service.metrics_url)[POOLING_QUEUE] == {"all-minilm-l6-v2": 0.0}

    texts = [f"sentence number {i} " + "about queues and forwards" for i in range(64)]
    observed: list[float] = []
    with grpc.insecure_channel(pooling_service.address) as channel:
        stub = pooling_pb2_grpc.PoolingStub(channel)
        calls = [stub.Embed.future(pooling_pb2.EmbedRequest(inputs=texts, truncate=True), timeout=120)
                 for _ in range(2)]
        done = threading.Event()
        threading.Thread(target=lambda: ([c.result() for c in calls], done.set()), daemon=True).start()
        while not done.is_set():  # a 64-text request spans several forwards (--max-batch-tokens 512)
            observed.append(scrape(pooling_service.metrics_url)[POOLING_QUEUE]["all-minilm-l6-v2"])
            time.sleep(0.01)
        assert [from_pb(c.result().embeddings).shape for c in calls] == [(64, 384)] * 2
    assert 0 < max(observed) <= 128
    assert scrape(pooling_service.metrics_url)[POOLING_QUEUE] == {"all-minilm-l6-v2": 0.0}


def test_metrics_port_is_checked_once_in_each_config():
    with pytest.raises(ValueError, match="metrics_port must be 0 .* got 65536"):
        DecoderConfig(metrics_port=65536)
    with pytest.raises(SystemExit):  # argparse's error: the PoolingConfig's ValueError, with usage
        pooling_main.parse_args(["--metrics-port", "-1"])


def test_decoder_collector_reads_one_engine_stats_snapshot_and_is_silent_while_loading():
    stats: list[EngineStats | None] = [None]
    collector = DecoderCollector("m", DecoderStats("m"), CacheInfo(16, 10, True, "float32", 4), lambda: stats[0])
    assert [(f.name, f.samples) for f in collector.collect()] == [
        (DECODER_WAITING, []), (DECODER_RUNNING, []), (DECODER_KV_USAGE, [])]
    stats[0] = EngineStats(num_blocks=10, num_free_blocks=7, num_running=2, num_waiting=5,
                           prefix_cache_query_tokens=9, prefix_cache_hit_tokens=3, num_adapter_swaps=1,
                           running_lora_adapters=("a", "b"), lora_updated_s=12.0)
    families = {f.name: [(s.labels, s.value) for s in f.samples] for f in collector.collect()}
    assert {name: families[name] for name in (DECODER_WAITING, DECODER_RUNNING, DECODER_KV_USAGE)} == {
        DECODER_WAITING: [({"model_name": "m"}, 5)], DECODER_RUNNING: [({"model_name": "m"}, 2)],
        DECODER_KV_USAGE: [({"model_name": "m"}, pytest.approx(0.3))]}
    assert families["vllm:prefix_cache_queries"] == [({"model_name": "m"}, 9)]
    assert families["vllm:prefix_cache_hits"] == [({"model_name": "m"}, 3)]
    assert families["tessera_adapter_swaps"] == [({"model_name": "m"}, 1)]
    assert families["vllm:lora_requests_info"] == [({"model_name": "m", "running_lora_adapters": "a,b",
                                                     "waiting_lora_adapters": "", "max_lora": "4"}, 12.0)]
    assert "vllm:request_success" in families  # the request metrics, from the same collector


DECODER_MODEL = "smollm2-135m-instruct"
DECODER_NAMES = {  # every family the issue names, with the sample that must be present
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
    "vllm:lora_requests_info", "vllm:cache_config_info",
    "tessera_adapter_swaps_total", "tessera_adapter_host_cache_hits_total"}


def _wait_idle(url: str) -> Samples:
    deadline = time.monotonic() + 30
    while True:
        now = samples(url)
        idle = now.get(DECODER_RUNNING) == 0 and now.get(DECODER_WAITING) == 0
        if idle or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def _generate(stub, prompt: list[int], max_tokens: int, stop_token_ids=()) -> list[int]:
    request = decoder_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=decoder_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, stop_token_ids=list(stop_token_ids)))
    return [t for response in stub.Generate(request, timeout=120) for t in response.token_ids]


def test_decoder_counters_and_histograms_count_a_known_workload_exactly(decoder_service):
    """Four sequential requests of one 40-token prompt (3 of 5 tokens, 1 stopped at its first
    token), then one aborted stream: vLLM's counters move by exactly the workload's counts."""
    url = decoder_service.metrics_url
    prompt = random.Random(time.time_ns()).sample(range(1000, 40000), 40)  # fresh: no cached prefix yet
    before = _wait_idle(url)
    assert before.sample_names >= DECODER_NAMES
    with grpc.insecure_channel(decoder_service.address) as channel:
        stub = decoder_pb2_grpc.DecoderStub(channel)
        outputs = [_generate(stub, prompt, 5) for _ in range(3)]
        assert [len(o) for o in outputs] == [5, 5, 5]
        assert _generate(stub, prompt, 5, stop_token_ids=[outputs[0][0]]) == [outputs[0][0]]  # greedy: same first
        after = _wait_idle(url)
        stream = stub.Generate(decoder_pb2.GenerateRequest(prompt_token_ids=prompt[:7], sampling=decoder_pb2.SamplingParams(
            max_tokens=400, ignore_eos=True)), timeout=120)
        next(stream)
        stream.cancel()
    aborted = _wait_idle(url)

    model = {"model_name": DECODER_MODEL}
    assert after.delta(before, "vllm:request_success_total", finished_reason="length", **model) == 3
    assert after.delta(before, "vllm:request_success_total", finished_reason="stop", **model) == 1
    assert after.delta(before, "vllm:request_success_total", finished_reason="abort", **model) == 0
    assert after.delta(before, "vllm:prompt_tokens_total", **model) == 4 * 40
    assert after.delta(before, "vllm:generation_tokens_total", **model) == 3 * 5 + 1
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds"):
        assert after.delta(before, f"{histogram}_count", **model) == 4, histogram
        assert after.delta(before, f"{histogram}_sum", **model) > 0, histogram
    assert after.delta(before, "vllm:inter_token_latency_seconds_count", **model) == 3 * 4  # gaps between tokens
    # prefix cache in tokens, as vLLM counts: each admission queries its 40 tokens; the 2nd..4th
    # reuse the first's two full 16-token blocks (never the last token's block)
    assert after.delta(before, "vllm:prefix_cache_queries_total", **model) == 4 * 40
    assert after.delta(before, "vllm:prefix_cache_hits_total", **model) == 3 * 32
    assert after.delta(before, "vllm:num_preemptions_total", **model) == 0
    assert after.get(DECODER_KV_USAGE, **model) == 0.0  # idle: cached blocks no request holds are free

    assert aborted.delta(after, "vllm:request_success_total", finished_reason="abort", **model) == 1
    assert aborted.delta(after, "vllm:prompt_tokens_total", **model) == 7
    assert aborted.delta(after, "vllm:e2e_request_latency_seconds_count", **model) == 1
    assert aborted.get(DECODER_KV_USAGE, **model) == 0.0
    assert aborted.get(DECODER_RUNNING, **model) == 0.0

    [cache_info] = aborted.labels("vllm:cache_config_info")
    assert cache_info == {"model_name": DECODER_MODEL, "block_size": "16", "num_gpu_blocks": "64",
                          "enable_prefix_caching": "True", "cache_dtype": "float32"}
    [lora_info] = aborted.labels("vllm:lora_requests_info")
    assert lora_info == {"model_name": DECODER_MODEL, "running_lora_adapters": "", "waiting_lora_adapters": "",
                         "max_lora": "8"}
    assert aborted.types["vllm:request_success"] == "counter"
    assert aborted.types["vllm:time_to_first_token_seconds"] == "histogram"


POOLING_HISTOGRAMS = ("tessera_pooling_batch_size", "tessera_pooling_batch_tokens",
                      "tessera_pooling_request_queue_duration_seconds",
                      "tessera_pooling_batch_inference_duration_seconds", "tessera_pooling_request_duration_seconds")


def test_pooling_histograms_count_a_known_workload(pooling_service):
    """Two Embed requests of 3 and 5 texts: 2 request durations, 8 queue waits, and batches whose
    sizes and (unpadded) tokens add up to the 8 texts and their token counts."""
    url = pooling_service.metrics_url
    texts = [f"metrics sentence {i} " + "with words " * i for i in range(8)]
    model = {"model_name": "all-minilm-l6-v2"}
    with grpc.insecure_channel(pooling_service.address) as channel:
        stub = pooling_pb2_grpc.PoolingStub(channel)
        num_tokens = sum(len(r.tokens) for r in stub.Tokenize(pooling_pb2.TokenizeRequest(inputs=texts)).results)
        before = samples(url)
        assert {f"{name}_count" for name in POOLING_HISTOGRAMS} <= before.sample_names
        stub.Embed(pooling_pb2.EmbedRequest(inputs=texts[:3]), timeout=60)
        stub.Embed(pooling_pb2.EmbedRequest(inputs=texts[3:]), timeout=60)
    after = samples(url)
    assert after.delta(before, "tessera_pooling_request_duration_seconds_count", **model) == 2
    assert after.delta(before, "tessera_pooling_request_queue_duration_seconds_count", **model) == 8
    assert after.delta(before, "tessera_pooling_batch_size_sum", **model) == 8
    assert after.delta(before, "tessera_pooling_batch_tokens_sum", **model) == num_tokens
    num_batches = after.delta(before, "tessera_pooling_batch_size_count", **model)
    assert num_batches >= 2  # sequential requests never share a forward
    assert after.delta(before, "tessera_pooling_batch_tokens_count", **model) == num_batches
    assert after.delta(before, "tessera_pooling_batch_inference_duration_seconds_count", **model) == num_batches
    assert after.get(POOLING_QUEUE, **model) == 0


def _png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(out, "PNG")
    return out.getvalue()


def test_vision_cache_counters_and_encode_seconds():
    """Three images, one of them twice in a second request: 4 lookups, 1 hit, 3 misses, 3 images
    encoded in 2 encoder forwards."""
    engine = VisionCore(VisionConfig(encoder=DemoEncoderConfig(output_width=64)))
    registry = make_registry(VisionCollector(lambda: engine))
    red, green, blue = (ImageSource(data=_png(c)) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255)))
    first = engine.encode(engine.process([red, green]))
    second = engine.encode(engine.process([red, blue]))
    row_bytes = sum(image.rows.numel() * image.rows.element_size() for image in [*first, second[1]])
    scraped = Samples.parse(generate_latest(registry).decode())
    model = {"model_name": engine.encoder.name}
    assert scraped.get("tessera_vision_encoder_cache_hits_total", **model) == 1
    assert scraped.get("tessera_vision_encoder_cache_misses_total", **model) == 3
    assert scraped.get("tessera_vision_images_encoded_total", **model) == 3
    assert scraped.get("tessera_vision_encode_seconds_count", **model) == 2
    assert scraped.get("tessera_vision_encoder_cache_bytes", **model) == row_bytes > 0
    assert Samples.parse(generate_latest(make_registry(VisionCollector(lambda: None))).decode()).get(
        "tessera_vision_encoder_cache_hits_total") == 0  # loading: no samples


def test_every_service_takes_metrics_port():
    assert vision_main.parse_args(["--metrics-port", "9091", "--output-width", "64"]).metrics_port == 9091
    assert gateway_main.parse_args(["--metrics-port", "9092"]).metrics_port == 9092
    assert adapters_main.parse_args(["--metrics-port", "9093"]).metrics_port == 9093
    with pytest.raises(SystemExit):
        vision_main.parse_args(["--metrics-port", "70000", "--output-width", "64"])
    with pytest.raises(ValueError, match="metrics_port must be 0 .* got -1"):
        GatewayConfig(metrics_port=-1)


def test_gateway_counts_downstream_calls_by_status_and_reports_replicas_up_and_down(
        decoder_service, pooling_service, gateway_service):
    """The live decoder replica is up, the dead one down; Embed and Generate calls through the
    gateway are counted per downstream by status, and timed."""
    pooled = {"service": "pooling", "replica": pooling_service.address, "method": "Embed"}
    generated = {"service": "decoder", "replica": decoder_service.address, "method": "Generate"}
    name, seconds = "tessera_gateway_downstream_requests_total", "tessera_gateway_downstream_request_duration_seconds"
    before = samples(gateway_service.metrics_url)
    with grpc.insecure_channel(gateway_service.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for _ in range(2):
            stub.Embed(pooling_pb2.EmbedRequest(inputs=["a sentence"]), timeout=60)
        with pytest.raises(grpc.RpcError) as refused:  # the pooler's own answer, relayed
            stub.Embed(pooling_pb2.EmbedRequest(inputs=["x"], model="no-such-model"), timeout=60)
        request = decoder_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=decoder_pb2.SamplingParams(
            max_tokens=3, ignore_eos=True))
        assert sum(len(r.token_ids) for r in stub.Generate(request, timeout=120)) == 3
    code = refused.value.code().name
    deadline = time.monotonic() + 10
    while True:  # each call is recorded when its status arrives, just after the client has it
        after = samples(gateway_service.metrics_url)
        counts = (after.delta(before, name, code="OK", **pooled), after.delta(before, name, code=code, **pooled),
                  after.delta(before, name, code="OK", **generated))
        if counts == (2, 1, 1) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert counts == (2, 1, 1), after.labels(name)
    assert after.delta(before, f"{seconds}_count", **pooled) == 3
    assert after.delta(before, f"{seconds}_count", **generated) == 1
    assert after.get("tessera_gateway_replica_up", service="decoder", replica=decoder_service.address) == 1
    assert after.get("tessera_gateway_replica_up", service="decoder", replica=gateway_service.dead_decoder) == 0
    assert after.get("tessera_gateway_replica_up", service="pooling", replica=pooling_service.address) == 1


def test_gateway_metrics_app_serves_on_an_asgi_http_app():
    """`services.gateway.metrics.asgi_app`, mounted on a FastAPI app as the gateway's HTTP port does."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from services.gateway.core import GatewayCore
    from services.gateway.metrics import asgi_app

    async def build() -> GatewayCore:  # its channels belong to a loop
        return GatewayCore(GatewayConfig(decoder=f"127.0.0.1:{free_port()}"))

    core = asyncio.run(build())
    app = FastAPI()
    app.mount("/metrics", asgi_app(core))
    reply = TestClient(app).get("/metrics/")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    scraped = Samples.parse(reply.text)
    assert scraped.get("tessera_gateway_replica_up", service="decoder", replica=core.config.decoder) == 0
    assert "process_resident_memory_bytes" in scraped.sample_names
