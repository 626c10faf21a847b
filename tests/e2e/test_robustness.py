"""Hostile input and a killed replica: the right status, and the rest of the cluster keeps serving."""

from __future__ import annotations

import math
import signal
import threading
import time

import grpc
import pytest

from services.common.server import CHANNEL_OPTIONS
from tessera.v1 import decoder_pb2, gateway_pb2, pooling_pb2

from .conftest import embed_once_back, once_back
from .test_generate import CHAT_PROMPTS, chat_request, collect


@pytest.mark.parametrize("sampling", [
    {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -1.0}, {"top_p": math.nan},
    {"top_p": 1.5}, {"top_k": -2}, {"min_p": 1.5},  # seed -1 is a seed (modulo 2**64, as vLLM): test_http_fidelity
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_bad_sampling_is_invalid_argument(gateway, assert_healthy, sampling):
    with pytest.raises(grpc.RpcError) as error:
        collect(gateway, chat_request(CHAT_PROMPTS[0], 4, **sampling))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert next(iter(sampling)) in error.value.details()
    assert_healthy()


def test_tiny_temperature_is_greedy_and_harms_no_neighbour(gateway):
    greedy = collect(gateway, chat_request(CHAT_PROMPTS[0], 12))["ids"]
    results = {}

    def neighbour():
        results["neighbour"] = collect(gateway, chat_request(CHAT_PROMPTS[0], 12))["ids"]

    thread = threading.Thread(target=neighbour)
    thread.start()
    results["tiny"] = collect(gateway, chat_request(CHAT_PROMPTS[0], 12, temperature=1e-38, top_k=5))["ids"]
    thread.join()
    assert results == {"neighbour": greedy, "tiny": greedy}


def test_invalid_utf8_is_invalid_argument(gateway_address, assert_healthy):
    valid = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text="AAAA")],
                                        sampling=decoder_pb2.SamplingParams(max_tokens=2)).SerializeToString()
    crafted = valid.replace(b"AAAA", b"\xed\xa0\x80\xff")
    with grpc.insecure_channel(gateway_address, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_stream("/tessera.v1.Gateway/Generate", request_serializer=lambda raw: raw,
                                    response_deserializer=decoder_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as error:
            list(call(crafted, timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "protobuf" in error.value.details()
    assert_healthy()


@pytest.mark.parametrize("messages", [
    [b"\xff\xff\xff\xff\xff"],                                          # not protobuf
    [pooling_pb2.EmbedRequest(inputs=["a"]).SerializeToString(), b"\x12\x02\xff\xfe"],  # then bad UTF-8
], ids=["garbage", "good-then-bad-utf8"])
def test_embed_stream_with_an_undecodable_message_is_invalid_argument(gateway_address, assert_healthy, messages):
    """The gateway relays the client's request stream to pooling; a message that does not parse
    must end the call with INVALID_ARGUMENT at once (grpc's relay used to swallow it: no status
    until the deadline)."""
    with grpc.insecure_channel(gateway_address, options=CHANNEL_OPTIONS) as channel:
        call = channel.stream_stream("/tessera.v1.Gateway/EmbedStream", request_serializer=lambda raw: raw,
                                     response_deserializer=pooling_pb2.EmbedResponse.FromString)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            list(call(iter(messages), timeout=20))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value
    assert "protobuf" in error.value.details() and time.monotonic() - start < 10
    assert_healthy()


def test_unknown_enum_value_is_invalid_argument(gateway):
    with pytest.raises(grpc.RpcError) as error:
        gateway.Embed(pooling_pb2.EmbedRequest(inputs=["x"], encoding_format=7), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "encoding_format" in error.value.details()


def test_killed_pooling_replica(cluster, gateway, assert_healthy):
    """Pooling down: Embed is UNAVAILABLE naming it, Generate and GetInfo keep working; then it comes back."""
    process = cluster.processes["pooling"]
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    try:
        with pytest.raises(grpc.RpcError) as error:
            gateway.Embed(pooling_pb2.EmbedRequest(inputs=["x"]), timeout=30)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "pooling" in error.value.details()
        assert collect(gateway, chat_request(CHAT_PROMPTS[0], 4))["finish"]
        info = gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30)
        assert info.decoder.num_blocks > 0 and not info.HasField("pooling")
        assert any("pooling" in line for line in info.unavailable)
    finally:
        cluster.restart("pooling")
    assert list(embed_once_back(gateway).embeddings.shape) == [1, 384]
    assert_healthy()


def test_a_frozen_service_is_listed_unavailable_by_get_info(cluster, gateway, assert_healthy):
    """A service that is alive but does not answer (SIGSTOP) must not hang GetInfo: the others'
    sections arrive and the frozen one is listed unavailable after the gateway's per-section cap."""
    from services.gateway.servicer import INFO_TIMEOUT_S

    # The gateway's channel to vision must be connected before the stop: a first connection to a stopped
    # peer fails its handshake at once ("is unavailable"), and this test is about a peer that hangs.
    assert gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30).HasField("vision")
    process = cluster.processes["vision"]
    process.send_signal(signal.SIGSTOP)
    try:
        infos = []
        for deadline in (60, 3):  # the gateway's cap, then a client deadline shorter than it
            start = time.monotonic()
            infos.append((gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=deadline),
                          time.monotonic() - start))
    finally:
        process.send_signal(signal.SIGCONT)
    assert infos[0][1] < INFO_TIMEOUT_S + 10 and infos[1][1] < 3
    for info, _ in infos:  # (the second may already see the frozen peer's connection time out)
        assert info.decoder.num_blocks > 0 and info.HasField("pooling") and not info.HasField("vision")
        assert any(line.startswith("vision service at") for line in info.unavailable), info.unavailable
    assert any("did not answer" in line for line in infos[0][0].unavailable), infos[0][0].unavailable
    assert_healthy()


def test_a_frozen_vision_service_fails_image_requests_instead_of_holding_them(cluster, gateway, assert_healthy):
    """The gateway's channel to vision pings (KEEPALIVE_OPTIONS): with vision stopped (SIGSTOP, its
    connection open), an image request with a long deadline ends UNAVAILABLE naming vision within
    the keepalive's ~8 s instead of waiting out its deadline; text requests are served meanwhile, and
    images again once vision answers."""
    from services.common.server import KEEPALIVE_TIME_MS, PING_TIMEOUT_MS

    from .test_images import image_request, png_bytes

    assert collect(gateway, image_request(png_bytes(40, 30)))["finish"]  # the channel is connected
    process = cluster.processes["vision"]
    process.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            collect(gateway, image_request(png_bytes(41, 30)))  # a deadline of 300 s
        elapsed = time.monotonic() - start
        assert collect(gateway, chat_request(CHAT_PROMPTS[0], 4))["finish"]
    finally:
        process.send_signal(signal.SIGCONT)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value
    # grpc's own error (a ping not acked), not an answer of the vision service's
    assert error.value.details().startswith("vision service at") and "answered by" not in error.value.details()
    assert elapsed < (KEEPALIVE_TIME_MS + PING_TIMEOUT_MS) / 1000 + 5, elapsed
    assert once_back(lambda: collect(gateway, image_request(png_bytes(40, 31))), timeout_s=30)["finish"]
    assert_healthy()
