"""A refused request releases what it brought at once: no service grows with refused requests.

Each request below is as large as the receiving service's gRPC limit allows, so it reaches the
service's own check and is refused there with INVALID_ARGUMENT. Before the fix the exception's
traceback (chained to grpc's AbortError on the call state) kept every refused payload in a
reference cycle until a full gc: pooling grew ~100 MiB per such Embed.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from services.common.auth import INTERNAL_TOKEN_METADATA
from services.common.server import CHANNEL_OPTIONS
from tessera.v1 import decoder_pb2, decoder_pb2_grpc, pooling_pb2, pooling_pb2_grpc

NUM_REFUSED = 10
WARMUP_ROUNDS = 5   # the allocator's arenas and grpc's connection buffers reach their working size
IDLE_S = 0.5        # what is measured is what a process holds when idle
RSS_TOLERANCE = 0.05
# allocator and log noise: a kept payload would cost >= 3 MB per refusal, >= 30 MB over NUM_REFUSED
RSS_FLOOR_BYTES = 16 << 20
# 3 M characters: over pooling's max_request_chars (2 M), under its receive limit (~9 MiB).
EMBED_INPUTS = ["a" * 1_000_000] * 3
# 5 MB of prompt with a sampling value every service refuses before tokenizing.
PROMPT = "b" * 5_000_000


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _refuse_embed(gateway) -> None:
    with pytest.raises(grpc.RpcError) as error:
        gateway.Embed(pooling_pb2.EmbedRequest(inputs=EMBED_INPUTS), timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()


def _refuse_generate(stub, metadata=()) -> None:
    request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text=PROMPT)],
                                          sampling=decoder_pb2.SamplingParams(max_tokens=4, temperature=-1.0))
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request, metadata=metadata, timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()


def test_refused_requests_leave_no_memory_behind(cluster, gateway):
    token = ((INTERNAL_TOKEN_METADATA, Path(cluster.token_file).read_text().strip()),)
    with grpc.insecure_channel(cluster.spec.address("decoder"), options=CHANNEL_OPTIONS) as channel:
        decoder = decoder_pb2_grpc.DecoderStub(channel)

        def refuse_all() -> None:
            _refuse_embed(gateway)       # gateway and pooling
            _refuse_generate(gateway)    # gateway and decoder
            _refuse_generate(decoder, token)

        for _ in range(WARMUP_ROUNDS):
            refuse_all()
        pids = {s: cluster.processes[s].pid for s in ("gateway", "pooling", "decoder")}
        time.sleep(IDLE_S)
        before = {s: _rss_bytes(pid) for s, pid in pids.items()}
        for _ in range(NUM_REFUSED):
            refuse_all()
        time.sleep(IDLE_S)
        after = {s: _rss_bytes(pid) for s, pid in pids.items()}
    grown = {s: f"{before[s] >> 20} -> {after[s] >> 20} MiB" for s in pids
             if after[s] - before[s] > max(before[s] * RSS_TOLERANCE, RSS_FLOOR_BYTES)}
    assert not grown, grown


def test_receive_limits_follow_each_service_caps(cluster):
    """Pooling receives every request its character cap allows (2 M characters of 4-byte UTF-8 reach
    its own check), and grpc refuses a message past that before reading it: RESOURCE_EXHAUSTED."""
    token = ((INTERNAL_TOKEN_METADATA, Path(cluster.token_file).read_text().strip()),)
    with grpc.insecure_channel(cluster.spec.address("pooling"), options=CHANNEL_OPTIONS) as channel:
        pooling = pooling_pb2_grpc.PoolingStub(channel)
        with pytest.raises(grpc.RpcError) as over_chars:
            pooling.Embed(pooling_pb2.EmbedRequest(inputs=["\U0001F600" * 2_000_001]), metadata=token, timeout=60)
        assert over_chars.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2000001" in over_chars.value.details().replace(",", "")
        with pytest.raises(grpc.RpcError) as over_bytes:
            pooling.Embed(pooling_pb2.EmbedRequest(inputs=["a" * (12 << 20)]), metadata=token, timeout=60)
        assert over_bytes.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with grpc.insecure_channel(cluster.spec.address("decoder"), options=CHANNEL_OPTIONS) as channel:
        request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text="c" * (40 << 20))])
        with pytest.raises(grpc.RpcError) as too_big:
            list(decoder_pb2_grpc.DecoderStub(channel).Generate(request, metadata=token, timeout=60))
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
