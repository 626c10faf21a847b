"""Every process `tessera up` starts serves Prometheus /metrics on the port `up` assigned it."""

from __future__ import annotations

import urllib.request

from tests.deploy.prom import Samples

# one family each service exports whatever it has served
EXPECTED = {"adapters": "process_resident_memory_bytes", "vision": "tessera_vision_encoder_cache_hits_total",
            "pooling": "tessera_pooling_queue_size", "decoder": "vllm:num_requests_running",
            "gateway": "tessera_gateway_replica_up"}


def test_every_service_serves_metrics_on_its_assigned_port(cluster):
    for service in cluster.spec.services():
        text = urllib.request.urlopen(cluster.spec.metrics_url(service), timeout=5).read().decode()
        names = Samples.parse(text).sample_names
        assert {EXPECTED[service], "process_resident_memory_bytes"} <= names, service
