"""The gateway's API /metrics relays each decoder replica's vllm:* series with a `replica` label,
and skips (and counts) a replica that is not ready or does not answer: real decoder stats
(services/decoder/stats.py) rendered as a replica renders them, served by stand-in GetMetrics stubs;
the cluster's: tests/e2e/test_metrics.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
from prometheus_client import generate_latest

from services.common.metrics import make_registry
from services.decoder.stats import DecoderStats
from services.gateway.metrics import REPLICA_LABEL, ReplicaMetrics, asgi_app
from tessera.v1 import decoder_pb2
from tests.deploy.prom import Samples


def _replica_text(num_prompt_tokens: int) -> str:
    """What a decoder's GetMetrics answers after one finished request."""
    stats = DecoderStats("m", max_model_len=512)
    request = SimpleNamespace(key="a", lora_name="", num_prompt_tokens=num_prompt_tokens,
                              sampling=SimpleNamespace(max_tokens=4))
    stats.on_arrival([request])
    stats.on_token(request)
    stats.on_finish(request, "length")
    return generate_latest(make_registry(stats)).decode()


class Stub:
    def __init__(self, text: str | None) -> None:
        self.text = text
        self.asked = 0

    async def GetMetrics(self, request, timeout):
        self.asked += 1
        assert isinstance(request, decoder_pb2.MetricsRequest) and timeout == 2.0
        if self.text is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "connection refused")
        return decoder_pb2.MetricsResponse(text=self.text)


def _pool(replicas: dict[str, tuple[Stub, bool]]):
    """A DecoderPool's face: replicas by address, and those ready."""
    by_address = {a: SimpleNamespace(address=a, stub=stub) for a, (stub, _) in replicas.items()}
    return SimpleNamespace(replicas=SimpleNamespace(
        service="decoder", replicas=by_address, ready=lambda: [by_address[a] for a, (_, up) in replicas.items() if up]))


def test_relays_each_replicas_vllm_series_and_counts_the_skipped():
    answering, failing, stopped = Stub(_replica_text(7)), Stub(None), Stub(_replica_text(9))
    pool = _pool({"10.0.0.1:1": (answering, True), "10.0.0.2:1": (failing, True), "10.0.0.3:1": (stopped, False)})
    relay = ReplicaMetrics(pool)
    for _ in range(2):
        scrape = Samples.parse(generate_latest(_Registry(asyncio.run(relay.collect()))).decode())
    assert stopped.asked == 0  # a replica not ready is not asked
    assert scrape.get("vllm:request_prompt_tokens_sum", replica="10.0.0.1:1") == 7
    assert {labels[REPLICA_LABEL] for labels in scrape.labels("vllm:request_prompt_tokens_sum")} == {"10.0.0.1:1"}
    assert not [n for n in scrape.sample_names if n.startswith(("process_", "python_"))
                or (n.startswith("vllm:") and n.endswith("_created"))]
    assert scrape.types["vllm:request_prompt_tokens"] == "histogram"
    up = {labels["replica"]: scrape.get("tessera_gateway_replica_metrics_up", **labels)
          for labels in scrape.labels("tessera_gateway_replica_metrics_up")}
    assert up == {"10.0.0.1:1": 1, "10.0.0.2:1": 0, "10.0.0.3:1": 0}
    assert scrape.get("tessera_gateway_replica_metrics_skipped_total", replica="10.0.0.2:1") == 2
    assert scrape.get("tessera_gateway_replica_metrics_skipped_total", replica="10.0.0.1:1") == 0


def test_two_replicas_merge_into_one_family_each():
    pool = _pool({"10.0.0.1:1": (Stub(_replica_text(7)), True), "10.0.0.2:1": (Stub(_replica_text(9)), True)})
    text = generate_latest(_Registry(asyncio.run(ReplicaMetrics(pool).collect()))).decode()
    assert text.count("# TYPE vllm:request_prompt_tokens histogram") == 1  # one family, as the format requires
    scrape = Samples.parse(text)
    assert [scrape.get("vllm:request_prompt_tokens_sum", replica=r) for r in ("10.0.0.1:1", "10.0.0.2:1")] == [7, 9]


def test_the_asgi_app_serves_the_gateways_own_series_then_the_replicas():
    core = SimpleNamespace(decoders=_pool({"10.0.0.1:1": (Stub(_replica_text(7)), True)}),
                           poolers=_pool({}))
    for pool in (core.decoders, core.poolers):
        pool.in_flight = _Zero()
        for replica in pool.replicas.replicas.values():
            replica.channel = SimpleNamespace(get_state=lambda: grpc.ChannelConnectivity.READY)
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(asgi_app(core)({"type": "http", "method": "GET", "path": "/metrics"}, None, send))
    assert sent[0]["status"] == 200
    scrape = Samples.parse(sent[1]["body"].decode())
    assert {"tessera_gateway_replica_up", "python_info", "vllm:request_prompt_tokens_count"} <= scrape.sample_names


class _Zero(dict):
    def __missing__(self, key):
        return 0


class _Registry:
    def __init__(self, families) -> None:
        self.families = families

    def collect(self):
        yield from self.families
