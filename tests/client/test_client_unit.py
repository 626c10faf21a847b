"""tessera.client without a cluster: what it imports, its status -> exception table, TLS and
tokens on the wire (an in-process gateway servicer that records metadata), and the `tessera
info` JSON keys."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import json_format

import tessera.client as tc
from services.common.launch import REPO
from tessera.cli.client import _json_names, cluster_rows, replica_table
from tessera.client import convert
from tessera.client.errors import STATUS_TO_ERROR, from_rpc_error
from tessera.v1 import adapters_pb2, decoder_pb2, gateway_pb2, gateway_pb2_grpc, pooling_pb2, vision_pb2

from ..test_auth import _self_signed


def test_client_imports_neither_torch_nor_transformers_nor_services():
    services = ('adapters', 'cli', 'common', 'decoder', 'gateway', 'pooling', 'vision')
    code = ("import sys; import tessera.client; from tessera.client import Client, AsyncClient; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            f"or (m.startswith('tessera.') and m.split('.')[1] in {services!r})))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_every_status_maps_to_its_exception():
    for code, cls in STATUS_TO_ERROR.items():
        error = from_rpc_error(_Failed(code, "why"))
        assert type(error) is cls and error.code == code and error.details == "why"
        assert str(error) == f"{code.name}: why"
    assert isinstance(from_rpc_error(_Failed(grpc.StatusCode.INVALID_ARGUMENT, "")), ValueError)
    other = from_rpc_error(_Failed(grpc.StatusCode.DATA_LOSS, "lost"))
    assert type(other) is tc.TesseraError and other.code == grpc.StatusCode.DATA_LOSS


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max_attempts is 0"):
        tc.RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="timeout is -1"):
        tc.Client("localhost:1", timeout=-1)


class _RecordingGateway(gateway_pb2_grpc.GatewayServicer):
    """Answers GetInfo and LoadAdapter with fixed messages and records each call's metadata."""

    def __init__(self):
        self.metadata: dict[str, dict[str, str]] = {}

    def GetInfo(self, request, context):
        self.metadata["GetInfo"] = dict(context.invocation_metadata())
        return gateway_pb2.ClusterInfo(unavailable=["pooling: down"], decoder=decoder_pb2.DecoderInfo(
            model="m", max_model_len=2048, num_blocks=10, num_free_blocks=5, resident_adapters=["a"]))

    def LoadAdapter(self, request, context):
        self.metadata["LoadAdapter"] = dict(context.invocation_metadata())
        return adapters_pb2.AdapterInfo(name=request.name, rank=4, target_modules=["q_proj"])


@pytest.fixture
def tls_gateway(tmp_path):
    cert_file, key_file = _self_signed(tmp_path)
    servicer = _RecordingGateway()
    server = grpc.server(ThreadPoolExecutor(2))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials([(key_file.read_bytes(), cert_file.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    yield f"127.0.0.1:{port}", cert_file, servicer
    server.stop(0)


def test_tls_and_tokens(tls_gateway, monkeypatch):
    address, cert_file, servicer = tls_gateway
    monkeypatch.setenv("TESSERA_ADMIN_TOKEN", "admin-from-env")
    with tc.Client(address, root_cert=cert_file, api_token="api-secret", timeout=10) as client:
        info = client.info()
        adapter = client.load_adapter("x", "x")
    assert info.decoder.max_model_len == 2048 and info.pooling is None and info.unavailable == ["pooling: down"]
    assert adapter == tc.AdapterInfo(name="x", digest="", rank=4, target_modules=["q_proj"], lora_alpha=0.0,
                                     use_rslora=False, path="", generation=0, state="", residency=[], leases=0)
    assert servicer.metadata["GetInfo"]["authorization"] == "Bearer api-secret"
    assert servicer.metadata["LoadAdapter"]["authorization"] == "Bearer admin-from-env"

    monkeypatch.setenv("TESSERA_TLS_ROOT_CERT", str(cert_file))
    monkeypatch.delenv("TESSERA_ADMIN_TOKEN")
    with tc.Client(address, timeout=10) as client:
        assert client.info().decoder.model == "m"  # TLS from the environment
    assert "authorization" not in servicer.metadata["GetInfo"]

    monkeypatch.delenv("TESSERA_TLS_ROOT_CERT")
    with tc.Client(address, timeout=5, retry=tc.NO_RETRY) as plaintext, pytest.raises(tc.Unavailable):
        plaintext.info()


def test_info_json_has_protobufs_json_keys():
    message = gateway_pb2.ClusterInfo(
        unavailable=["vision: down"],
        decoder=decoder_pb2.DecoderInfo(model="m", max_model_len=2048, mrope_section=[8, 12, 12],
                                        served_model_names=["m", "m-alias"], generation_config="auto",
                                        generation_defaults={"temperature": 0.6, "top_k": 0.0, "top_p": 0.9}),
        pooling=pooling_pb2.PoolingInfo(model="p", models=[
            pooling_pb2.PoolingModelInfo(model="p", prompts={"query_prompt": "Q"}, aliases=["p-alias"])]),
        vision=vision_pb2.VisionInfo(encoder="demo", encoder_cache=vision_pb2.EncoderCacheStats()),
        replicas=[gateway_pb2.ReplicaInfo(service="decoder", address="h:1", ready=True)])
    ours = _json_names(convert.cluster_info(message))
    assert ours == json.loads(json_format.MessageToJson(message))
    assert ours["decoder"]["generationDefaults"] == {"temperature": 0.6, "top_k": 0.0, "top_p": 0.9}  # map keys kept


def test_info_table_shows_served_names_and_generation_defaults():
    message = gateway_pb2.ClusterInfo(
        decoder=decoder_pb2.DecoderInfo(model="org/m", architecture="LlamaForCausalLM",
                                        served_model_names=["org/m", "m", "mm"], generation_config="auto",
                                        generation_defaults={"temperature": 0.6, "top_p": 0.9}),
        pooling=pooling_pb2.PoolingInfo(model="p", models=[pooling_pb2.PoolingModelInfo(
            model="org/p", kind="embedding", dimension=384, max_input_length=256, aliases=["p"])]))
    rows = dict(cluster_rows(convert.cluster_info(message), []))
    assert rows["model"] == "org/m (LlamaForCausalLM)" and rows["aliases"] == "m, mm"
    assert rows["sampling"] == "auto: temperature=0.6 top_p=0.9 (generation_config.json)"
    assert rows["embedding"].startswith("org/p (384 dims") and rows["embedding"].endswith(", also p)")
    neutral = gateway_pb2.ClusterInfo(decoder=decoder_pb2.DecoderInfo(model="m", served_model_names=["m"],
                                                                      generation_config="vllm"))
    rows = dict(cluster_rows(convert.cluster_info(neutral), []))
    assert rows["sampling"] == "vllm: neutral defaults" and "aliases" not in rows


def test_replica_table_rows():
    message = gateway_pb2.ClusterInfo(replicas=[
        gateway_pb2.ReplicaInfo(service="decoder", address="h:1", ready=True, state="READY", num_requests=7,
                                num_outstanding=1, decoder=decoder_pb2.DecoderInfo(
                                    num_blocks=10, num_free_blocks=5, num_running=1, num_waiting=2,
                                    resident_adapters=["hot", "warm"])),
        gateway_pb2.ReplicaInfo(service="pooling", address="h:2", state="CONNECTING")])
    header, decoder, pooling = replica_table(convert.cluster_info(message)).splitlines()
    assert header.split() == ["replica", "address", "health", "sent", "now", "run", "wait", "kv", "adapters"]
    assert decoder.split() == ["decoder", "h:1", "SERVING", "7", "1", "1", "2", "50%", "hot,warm"]
    assert pooling.split() == ["pooling", "h:2", "not", "ready", "(CONNECTING)", "0", "0", "-", "-", "-", "-"]


def test_truncation_direction_reaches_the_requests():
    from tessera.client import convert
    from tessera.v1 import pooling_pb2

    left = convert.embed_request("x", input_ids=None, model="", normalize=None, dimensions=None, truncate=True,
                                 prompt_name="", encoding_format="float", direction="left")
    assert left.truncation_direction == pooling_pb2.TRUNCATION_DIRECTION_LEFT and left.truncate
    ranked = convert.rerank_request("q", ["d"], top_n=None, return_documents=False, model="", raw_scores=False,
                                    truncate=True, direction="left")
    assert ranked.truncation_direction == pooling_pb2.TRUNCATION_DIRECTION_LEFT and ranked.truncate
    with pytest.raises(ValueError, match="truncation_direction is 'right' or 'left'; got 'middle'"):
        convert.rerank_request("q", ["d"], top_n=None, return_documents=False, model="", raw_scores=False,
                               truncate=True, direction="middle")
