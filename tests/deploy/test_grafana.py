"""deploy/grafana/tessera.json: an importable dashboard whose every query names metrics the services export."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import grpc
from prometheus_client import generate_latest

from services.common.metrics import make_registry
from services.vision.config import VisionConfig
from services.vision.core import VisionCore
from services.vision.encoder import DemoEncoderConfig
from services.vision.stats import VisionCollector
from tessera.v1 import decoder_pb2, gateway_pb2_grpc, pooling_pb2
from tests.deploy.prom import Samples

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tessera.json"
METRIC = re.compile(r"\b(?:vllm:|tessera_)[a-zA-Z0-9_:]+")
REQUIRED = {  # what the dashboard must show
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:generation_tokens_total", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total",
    "vllm:lora_requests_info", "tessera_adapter_swaps_total"}


def _queries(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_dashboard_is_importable_json_with_a_prometheus_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "tessera" and "id" not in dashboard
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
    queries = " ".join(_queries(dashboard))
    assert all(f"histogram_quantile({q}, " in queries for q in ("0.5", "0.95", "0.99"))
    assert set(METRIC.findall(queries)) >= REQUIRED


def test_every_metric_the_dashboard_queries_is_exported(decoder_service, pooling_service, gateway_service):
    """Names in the queries against one scrape of each service (the gateway's after a call each way,
    since labelled series appear with their first call; vision's from an engine in this process)."""
    with grpc.insecure_channel(gateway_service.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        stub.Embed(pooling_pb2.EmbedRequest(inputs=["a sentence"]), timeout=60)
        list(stub.Generate(decoder_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling=decoder_pb2.SamplingParams(
            max_tokens=2)), timeout=120))
    texts = [urllib.request.urlopen(s.metrics_url, timeout=5).read().decode()
             for s in (decoder_service, pooling_service, gateway_service)]
    engine = VisionCore(VisionConfig(encoder=DemoEncoderConfig(output_width=64)))
    texts.append(generate_latest(make_registry(VisionCollector(lambda: engine))).decode())
    exported = set().union(*(Samples.parse(text).sample_names for text in texts))
    queried = set(METRIC.findall(" ".join(_queries(json.loads(DASHBOARD.read_text())))))
    assert queried - exported == set()
