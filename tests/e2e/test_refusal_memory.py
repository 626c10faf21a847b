"""A refused request releases what it brought at once: no service grows with refused requests.

Each request below is as large as the receiving service's gRPC limit allows, so it reaches the
service's own check and is refused there with INVALID_ARGUMENT. Before the fix the exception's
traceback (chained to grpc's AbortError on the call state) kept every refused payload in a
reference cycle until a full gc: pooling grew ~100 MiB per such Embed.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from services.common.auth import INTERNAL_TOKEN_METADATA
from services.common.server import CHANNEL_OPTIONS
from tessera.v1 import decoder_pb2, decoder_pb2_grpc, pooling_pb2

NUM_REFUSED = 10
RSS_TOLERANCE = 0.05
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

        refuse_all()  # warm-up: the allocator's arenas now exist
        pids = {s: cluster.processes[s].pid for s in ("gateway", "pooling", "decoder")}
        before = {s: _rss_bytes(pid) for s, pid in pids.items()}
        for _ in range(NUM_REFUSED):
            refuse_all()
        after = {s: _rss_bytes(pid) for s, pid in pids.items()}
    print({s: f"{before[s] >> 20} -> {after[s] >> 20} MiB" for s in pids})
    grown = {s: f"{before[s] >> 20} -> {after[s] >> 20} MiB" for s in pids
             if after[s] > before[s] * (1 + RSS_TOLERANCE)}
    assert not grown, grown
