"""Prometheus /metrics of real decoder and pooling processes, parsed as Prometheus parses them."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import (
    DECODER_KV_USAGE,
    DECODER_RUNNING,
    DECODER_WAITING,
    POOLING_QUEUE,
    DecoderCollector,
)
from services.common.tensor import from_pb
from services.decoder.config import DecoderConfig
from services.decoder.engine import EngineStats
from services.pooling import __main__ as pooling_main
from tessera.v1 import decoder_pb2, decoder_pb2_grpc, pooling_pb2, pooling_pb2_grpc


def scrape(url: str) -> dict[str, dict[str, float]]:
    """metric name -> {model_name label: value}."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {family.name: {s.labels.get("model_name", ""): s.value for s in family.samples}
            for family in text_string_to_metric_families(text)}


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


def test_decoder_collector_reads_engine_stats_and_is_silent_while_loading():
    stats: list[EngineStats | None] = [None]
    collector = DecoderCollector("m", lambda: stats[0])
    assert [(f.name, f.samples) for f in collector.collect()] == [
        (DECODER_WAITING, []), (DECODER_RUNNING, []), (DECODER_KV_USAGE, [])]
    stats[0] = EngineStats(num_blocks=10, num_free_blocks=7, num_running=2, num_waiting=5)
    assert {f.name: [(s.labels, s.value) for s in f.samples] for f in collector.collect()} == {
        DECODER_WAITING: [({"model_name": "m"}, 5)], DECODER_RUNNING: [({"model_name": "m"}, 2)],
        DECODER_KV_USAGE: [({"model_name": "m"}, pytest.approx(0.3))]}
