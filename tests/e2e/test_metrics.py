"""Every process `tessera up` starts serves Prometheus /metrics on the port `up` assigned it, and the
gateway's HTTP API /metrics serves every series vLLM's reference Grafana dashboard reads."""

from __future__ import annotations

import re
import urllib.request

import requests

from tessera.v1 import gateway_pb2
from tests.deploy.prom import Samples

# one family each service exports whatever it has served
EXPECTED = {"adapters": "process_resident_memory_bytes", "vision": "tessera_vision_encoder_cache_hits_total",
            "pooling": "tessera_pooling_queue_size", "decoder": "vllm:num_requests_running",
            "gateway": "tessera_gateway_replica_up"}
# what prometheus_client's default registry serves besides, and docs/operations.md promises
PROCESS_SERIES = {"process_resident_memory_bytes", "python_info", "python_gc_objects_collected_total"}

# The queries of vLLM's reference dashboard (vllm-project/vllm examples/online_serving/
# prometheus_grafana/grafana.json), one per target, as its panels hold them. Two series carry the
# names vLLM V1 gave them, as the dashboard reads them since: vllm:kv_cache_usage_perc (the V0
# dashboard: vllm:gpu_cache_usage_perc) and vllm:inter_token_latency_seconds (V0:
# vllm:time_per_output_token_seconds); V1 has no vllm:num_requests_swapped or
# vllm:cpu_cache_usage_perc (no swapping, no CPU cache), which its dashboard dropped.
VLLM_DASHBOARD_QUERIES = (
    # E2E Request Latency
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    # Token Throughput
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    # Time Per Output Token Latency
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'rate(vllm:inter_token_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:inter_token_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    # Scheduler State
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    # Time To First Token Latency
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    # Cache Utilization
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    # Request Prompt Length, Request Generation Length (heatmaps)
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    # Finish Reason
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    # Queue Time
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    # Requests Prefill and Decode Time
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    # Max Generation Token in Sequence Group
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
)


def dashboard_series() -> set[str]:
    """Every series name the dashboard's queries read."""
    return {name for query in VLLM_DASHBOARD_QUERIES for name in re.findall(r"vllm:[a-zA-Z0-9_:]+", query)}


def test_every_service_serves_metrics_on_its_assigned_port(cluster):
    for service in cluster.spec.services():
        text = urllib.request.urlopen(cluster.spec.metrics_url(service), timeout=5).read().decode()
        names = Samples.parse(text).sample_names
        assert {EXPECTED[service], *PROCESS_SERIES} <= names, service


def test_the_gateways_api_metrics_serve_every_series_of_vllms_dashboard(cluster, http_url, gateway):
    """After one chat, one scrape of the public endpoint fills every panel of vLLM's dashboard: each
    decoder replica's vllm:* series, labelled with its replica (and the model), beside the gateway's own."""
    spec = cluster.spec
    decoder_info = gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30).decoder
    model = (list(decoder_info.served_model_names) or [decoder_info.model])[0]
    answer = requests.post(f"{http_url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3})
    assert answer.status_code == 200, answer.text
    scrape = Samples.parse(requests.get(f"{http_url}/metrics", timeout=30).text)
    missing = dashboard_series() - scrape.sample_names
    assert not missing, f"vLLM's dashboard reads {sorted(missing)}, which the gateway's /metrics does not serve"
    assert {"tessera_gateway_replica_up", *PROCESS_SERIES} <= scrape.sample_names
    decoder = spec.address("decoder")
    for name in ("vllm:request_prompt_tokens_count", "vllm:request_decode_time_seconds_count"):
        [labels] = scrape.labels(name)
        assert labels["replica"] == decoder and labels["model_name"], labels
    assert scrape.get("vllm:request_generation_tokens_count", replica=decoder) >= 1
    assert scrape.get("tessera_gateway_replica_metrics_up", service="decoder", replica=decoder) == 1
