"""The session cluster logs JSON (tests/e2e/conftest.py): every line of every service's log
parses, and one request's id is on its lines in the gateway and in the decoder, over gRPC and
over HTTP."""

from __future__ import annotations

import json
import time
import uuid

import grpc
import pytest
import requests

from tessera.cli.up.spec import service_of
from tessera.v1 import gateway_pb2

from .test_generate import chat_request, collect

FIELDS = ("ts", "level", "service", "logger", "message")


def _records(cluster, service: str) -> list[dict]:
    path = cluster.spec.log_dir / f"{service}.log"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _lines_of(cluster, service: str, request_id: str, count: int) -> list[dict]:
    """The request lines carrying `request_id` in `service`'s log, once there are `count` (the
    lines are written when each call ends, by the log's reader thread in `up`)."""
    deadline = time.monotonic() + 10
    while True:
        lines = [r for r in _records(cluster, service)
                 if r.get("request_id") == request_id and r["logger"].startswith("tessera.requests")]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_one_grpc_request_id_is_on_the_gateway_and_decoder_lines(cluster, gateway):
    request_id = f"e2e-{uuid.uuid4().hex}"
    reply = collect_with_id(gateway, chat_request("Name a colour.", 4), request_id)
    [gateway_line] = _lines_of(cluster, "gateway", request_id, 1)
    [decoder_line] = _lines_of(cluster, "decoder", request_id, 1)
    assert gateway_line["method"] == "/tessera.v1.Gateway/Generate"
    assert decoder_line["method"] == "/tessera.v1.Decoder/Generate"
    for line in (gateway_line, decoder_line):
        assert line["status"] == "OK" and line["level"] == "INFO" and line["latency_ms"] > 0
        assert line["prompt_tokens"] == reply["usage"].prompt_tokens > 0
        assert line["completion_tokens"] == len(reply["ids"]) > 0
    assert gateway_line["latency_ms"] >= decoder_line["latency_ms"]


def collect_with_id(gateway, request, request_id: str) -> dict:
    ids, usage = [], None
    for response in gateway.Generate(request, timeout=300, metadata=(("x-request-id", request_id),)):
        ids.extend(response.token_ids)
        usage = response.usage if response.HasField("usage") else usage
    return {"ids": ids, "usage": usage}


def test_a_refused_request_logs_its_status_under_its_id(cluster, gateway):
    request_id = f"e2e-{uuid.uuid4().hex}"
    request = chat_request("x", 4)
    request.sampling.temperature = -1.0
    with pytest.raises(grpc.RpcError) as refused:
        list(gateway.Generate(request, timeout=60, metadata=(("x-request-id", request_id),)))
    [line] = _lines_of(cluster, "gateway", request_id, 1)
    assert line["status"] == refused.value.code().name == "INVALID_ARGUMENT"


def test_an_http_request_echoes_its_id_and_shares_it_downstream(cluster, http_url, gateway):
    request_id = f"e2e-http-{uuid.uuid4().hex}"
    model = cluster_model(gateway)
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    answer = requests.post(f"{http_url}/v1/chat/completions", json=body, headers={"X-Request-Id": request_id},
                           timeout=300)
    assert answer.status_code == 200 and answer.headers["x-request-id"] == request_id
    [http_line] = _lines_of(cluster, "gateway", request_id, 1)  # the core is called in process: one line
    assert (http_line["logger"], http_line["route"], http_line["status"]) == (
        "tessera.requests.http", "/v1/chat/completions", 200)
    [decoder_line] = _lines_of(cluster, "decoder", request_id, 1)
    assert decoder_line["completion_tokens"] == answer.json()["usage"]["completion_tokens"]

    made = requests.post(f"{http_url}/v1/chat/completions", json=body, timeout=300).headers["x-request-id"]
    assert len(made) == 32 and _lines_of(cluster, "decoder", made, 1)


def cluster_model(gateway) -> str:
    return gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30).decoder.model


def test_every_line_of_every_log_is_one_json_object(cluster, gateway):
    collect(gateway, chat_request("Say hi.", 2))  # at least one request line in the gateway's and decoder's logs
    for service in cluster.spec.services():
        records = _records(cluster, service)  # json.loads of each line raises on any that is not JSON
        assert records, service
        for record in records:
            assert all(field in record for field in FIELDS), record
            assert record["service"] == service_of(service)
    assert any(r["logger"] == "tessera.requests" for r in _records(cluster, "decoder"))

