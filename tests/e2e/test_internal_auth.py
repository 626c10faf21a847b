"""Internal hops are authenticated: the cluster's internal ports refuse callers without its token.

`tessera up` (the `cluster` fixture) writes a per-cluster token and hands every service the file's
path; the gateway and the decoder send it on every internal call, so the public path works end to
end while a caller that reaches an internal port directly gets UNAUTHENTICATED.
"""

from __future__ import annotations

import stat
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.auth import INTERNAL_TOKEN_METADATA
from tessera.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    decoder_pb2,
    decoder_pb2_grpc,
    pooling_pb2,
    pooling_pb2_grpc,
    vision_pb2,
    vision_pb2_grpc,
)

# One cheap read-only RPC per internal service: (stub, method, request).
INTERNAL_CALLS = {
    "vision": (vision_pb2_grpc.VisionStub, "GetInfo", vision_pb2.VisionInfoRequest()),
    "decoder": (decoder_pb2_grpc.DecoderStub, "GetInfo", decoder_pb2.DecoderInfoRequest()),
    "pooling": (pooling_pb2_grpc.PoolingStub, "GetInfo", pooling_pb2.PoolingInfoRequest()),
    "adapters": (adapters_pb2_grpc.AdaptersStub, "ListAdapters", adapters_pb2.ListAdaptersRequest()),
}


def _token(cluster) -> str:
    return Path(cluster.token_file).read_text().strip()


def _call(cluster, service: str, metadata: tuple = ()):
    stub_class, method, request = INTERNAL_CALLS[service]
    with grpc.insecure_channel(cluster.spec.address(service)) as channel:
        return getattr(stub_class(channel), method)(request, metadata=metadata, timeout=30)


@pytest.mark.parametrize("service", INTERNAL_CALLS)
def test_internal_port_refuses_a_call_without_the_token(cluster, service):
    with pytest.raises(grpc.RpcError) as missing:
        _call(cluster, service)
    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert INTERNAL_TOKEN_METADATA in missing.value.details()
    with pytest.raises(grpc.RpcError) as wrong:
        _call(cluster, service, ((INTERNAL_TOKEN_METADATA, _token(cluster) + "x"),))
    assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "does not match" in wrong.value.details()


@pytest.mark.parametrize("service", INTERNAL_CALLS)
def test_internal_port_accepts_the_token(cluster, service):
    assert _call(cluster, service, ((INTERNAL_TOKEN_METADATA, _token(cluster)),)) is not None


def test_refused_stream_is_unauthenticated_before_any_work(cluster):
    """A streaming RPC (Generate) is refused the same way; nothing is generated."""
    request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text="hi")],
                                          sampling=decoder_pb2.SamplingParams(max_tokens=4))
    with grpc.insecure_channel(cluster.spec.address("decoder")) as channel, pytest.raises(grpc.RpcError) as error:
        list(decoder_pb2_grpc.DecoderStub(channel).Generate(request, timeout=30))
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("service", ["gateway", *INTERNAL_CALLS])
def test_health_and_reflection_need_no_token(cluster, service):
    """kubelet and compose probes send no metadata; grpcurl lists services without it."""
    with grpc.insecure_channel(cluster.spec.address(service)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = [s.name for answer in answers for s in answer.list_services_response.service]
    assert "grpc.health.v1.Health" in names


def test_public_path_works_with_auth_on(gateway):
    """The gateway sends the token on its internal calls: a client needs none."""
    reply = gateway.Embed(pooling_pb2.EmbedRequest(inputs=["authenticated hop"]), timeout=60)
    assert reply.embeddings.shape == [1, 384]


def test_token_file_is_private_and_never_in_argv(cluster):
    token = _token(cluster)
    assert len(token) >= 32
    assert stat.S_IMODE(Path(cluster.token_file).stat().st_mode) == 0o600
    for service, process in cluster.processes.items():
        argv = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert token.encode() not in argv, service
        environ = Path(f"/proc/{process.pid}/environ").read_bytes()
        assert f"TESSERA_INTERNAL_TOKEN_FILE={cluster.token_file}".encode() in environ, service
