"""Real service processes for the probe and metrics tests: a pooler and a decoder, each serving
Prometheus /metrics on a free port (the prepared default models; `make test` prepares them)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.common.launch import ServiceProcess, free_port


@dataclass
class Running:
    address: str
    metrics_url: str


@pytest.fixture(scope="session")
def pooling_service():
    port = free_port()
    # a small token budget: one 64-text request takes several forwards, the rest of it queued meanwhile
    args = ["--metrics-port", str(port), "--max-wait-ms", "0", "--max-batch-tokens", "512"]
    with ServiceProcess("services.pooling", args) as service:
        yield Running(service.address, f"http://127.0.0.1:{port}/metrics")


@pytest.fixture(scope="session")
def decoder_service():
    port = free_port()
    # one running sequence at a time, so concurrent streams queue and the waiting gauge moves
    args = ["--metrics-port", str(port), "--max-num-seqs", "1", "--max-model-len", "512", "--num-blocks", "64"]
    with ServiceProcess("services.decoder", args, startup_s=180) as service:
        yield Running(service.address, f"http://127.0.0.1:{port}/metrics")


@dataclass
class Gateway(Running):
    dead_decoder: str  # a second decoder replica address that nothing serves


@pytest.fixture(scope="session")
def gateway_service(decoder_service, pooling_service):
    """A gateway over the decoder, a decoder address nobody serves, and the pooler; /metrics on its
    own port (`--metrics-port`)."""
    port, dead = free_port(), f"127.0.0.1:{free_port()}"
    args = ["--decoder", f"ipv4:{decoder_service.address},{dead}", "--pooling", pooling_service.address,
            "--adapters", f"127.0.0.1:{free_port()}", "--vision", "", "--metrics-port", str(port)]
    with ServiceProcess("services.gateway", args) as service:
        yield Gateway(service.address, f"http://127.0.0.1:{port}/metrics", dead)
