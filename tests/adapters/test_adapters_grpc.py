"""End to end over a real socket: `python -m services.adapters` in a subprocess."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.adapters.peft_format import read_peft_adapter
from services.common.launch import ServiceProcess
from services.common.tensor import from_pb
from tessera.v1 import adapters_pb2, adapters_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cret"
ADMIN = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture()
def registry_address(root, adapter_in_root, base_model_dir):
    args = ["--root", str(root), "--base-model-dir", str(base_model_dir), "--max-rank", "8"]
    service = ServiceProcess("services.adapters", args, env={"TESSERA_ADMIN_TOKEN": TOKEN})
    with service:
        yield service.address
    assert service.process.returncode == 0, service.log()[-2000:]


def _code(call, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()


def test_registry_over_grpc(registry_address, root, adapter_in_root):
    with grpc.insecure_channel(registry_address) as channel:
        stub = adapters_pb2_grpc.AdaptersStub(channel)
        load = adapters_pb2.LoadAdapterRequest(name="support", path="plain")
        code, details = _code(stub.LoadAdapter, load)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details
        code, _ = _code(stub.LoadAdapter, load, metadata=(("authorization", "Bearer wrong"),))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        code, _ = _code(stub.UnloadAdapter, adapters_pb2.UnloadAdapterRequest(name="support"))
        assert code == grpc.StatusCode.UNAUTHENTICATED

        info = stub.LoadAdapter(load, metadata=ADMIN)
        assert (info.name, info.generation, info.rank, info.state, info.path) == ("support", 1, 4, "ready", "plain")
        assert info.lora_alpha == 8.0 and not info.use_rslora and len(info.target_modules) == 4
        assert _code(stub.LoadAdapter, load, metadata=ADMIN)[0] == grpc.StatusCode.ALREADY_EXISTS
        escape = adapters_pb2.LoadAdapterRequest(name="x", path="../../etc")
        code, details = _code(stub.LoadAdapter, escape, metadata=ADMIN)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the adapter root" in details
        assert [a.name for a in stub.ListAdapters(adapters_pb2.ListAdaptersRequest()).adapters] == ["support"]

        meta = stub.GetAdapter(adapters_pb2.GetAdapterRequest(name="support"))
        assert meta.info == info and len(meta.tensors) == 0
        full = stub.GetAdapter(adapters_pb2.GetAdapterRequest(name="support", include_weights=True))
        expected = read_peft_adapter(adapter_in_root, root, "support", 64)
        assert [t.module for t in full.tensors] == sorted(expected.targets)
        for tensor in full.tensors:
            torch.testing.assert_close(from_pb(tensor.lora_a), expected.targets[tensor.module].lora_a, rtol=0, atol=0)
            torch.testing.assert_close(from_pb(tensor.lora_b), expected.targets[tensor.module].lora_b, rtol=0, atol=0)
        code, details = _code(stub.GetAdapter, adapters_pb2.GetAdapterRequest(name="nope"))
        assert code == grpc.StatusCode.NOT_FOUND and details == "unknown adapter 'nope'"

        stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="support"), metadata=ADMIN)
        assert _code(stub.UnloadAdapter, adapters_pb2.UnloadAdapterRequest(name="support"),
                     metadata=ADMIN)[0] == grpc.StatusCode.NOT_FOUND
        assert list(stub.ListAdapters(adapters_pb2.ListAdaptersRequest()).adapters) == []
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.LoadAdapter(load, metadata=ADMIN).generation == 2

        # Client input quoted in a message is cut: a 20k-character name or path still gets its real
        # status (whole, it would overflow gRPC's 16 KiB trailer and read as RESOURCE_EXHAUSTED).
        huge = "x" * 20_000
        for call, request, metadata in [
                (stub.GetAdapter, adapters_pb2.GetAdapterRequest(name=huge), ()),
                (stub.GetAdapter, adapters_pb2.GetAdapterRequest(name=huge, include_weights=True), ()),
                (stub.UnloadAdapter, adapters_pb2.UnloadAdapterRequest(name=huge), ADMIN),
                (stub.LoadAdapter, adapters_pb2.LoadAdapterRequest(name=huge, path="plain"), ADMIN),
                (stub.LoadAdapter, adapters_pb2.LoadAdapterRequest(name="y", path=huge), ADMIN)]:
            code, details = _code(call, request, metadata=metadata)
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (code, details[:200])
            assert len(details) < 1200
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_load_adapter_refuses_disagreeing_or_overflowing_adapters(registry_address, root, adapter_in_root,
                                                                  edit_adapter_config):
    """Observed: target_modules ["nonexistent_proj"] over q_proj/v_proj weights, and lora_B x 1e37
    (finite in float32), both loaded and were applied. Both are INVALID_ARGUMENT at LoadAdapter."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter_in_root, root / "nowhere")
    edit_adapter_config(root / "nowhere", target_modules=["nonexistent_proj"])
    shutil.copytree(adapter_in_root, root / "huge")
    weights = root / "huge" / "adapter_model.safetensors"
    save_file({k: v * 1e37 if "lora_B" in k else v for k, v in load_file(str(weights)).items()}, str(weights))
    with grpc.insecure_channel(registry_address) as channel:
        stub = adapters_pb2_grpc.AdaptersStub(channel)
        for path, needle in [("nowhere", "target_modules entry 'nonexistent_proj' matches no linear module"),
                             ("huge", "the effective LoRA delta (scale * B @ A) reaches up to")]:
            code, details = _code(stub.LoadAdapter, adapters_pb2.LoadAdapterRequest(name=path, path=path),
                                  metadata=ADMIN)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, (code, details)
        assert list(stub.ListAdapters(adapters_pb2.ListAdaptersRequest()).adapters) == []
