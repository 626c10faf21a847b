"""Adapters are tied to the base model they were registered against, and each cluster has its own
catalog: an adapter recorded for another base (or for an unknown one, in a catalog older than the
record) is listed as not servable and refused with FAILED_PRECONDITION naming both bases."""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
from pathlib import Path

import grpc
import pytest
from transformers import LlamaConfig

from services.adapters.__main__ import parse_args
from services.adapters.config import RegistryConfig
from services.adapters.engine import AdapterRegistry
from services.adapters.servicer import register
from services.common.checkpoint import CheckpointConfig, base_model_digest
from services.common.errors import AlreadyExists, FailedPrecondition
from services.common.server import create_server
from tessera.cli.up.spec import ClusterSpec
from tessera.v1 import adapters_pb2, adapters_pb2_grpc
from tests.adapters.conftest import TINY_LLAMA

# The catalog's first schema, before rows recorded their base model.
OLD_SCHEMA = """CREATE TABLE adapters (name TEXT PRIMARY KEY, path TEXT NOT NULL, digest TEXT NOT NULL,
    rank INTEGER NOT NULL, alpha REAL NOT NULL, use_rslora INTEGER NOT NULL, targets TEXT NOT NULL,
    generation INTEGER NOT NULL, state TEXT NOT NULL, created_at REAL NOT NULL)"""


def _checkpoint(directory: Path, **changes) -> Path:
    """A tiny Llama config.json (no weights) with `changes` applied."""
    LlamaConfig(**{**TINY_LLAMA, **changes}).save_pretrained(str(directory))
    return directory


@pytest.fixture()
def other_base(tmp_path) -> Path:
    """Base B: the same linear shapes as the tiny Llama, another vocabulary (so an adapter's factors
    would load without a shape error and silently mean something else)."""
    return _checkpoint(tmp_path / "base-b", vocab_size=128)


def _registry(root: Path, db: Path, base: Path | None) -> AdapterRegistry:
    return AdapterRegistry(RegistryConfig(root=root, db_path=db, base_model_dir=base, report_ttl_s=0.5))


async def _over_grpc(registry: AdapterRegistry, calls):
    """`calls(stub)` against `registry` served by the registry's servicer on a loopback port."""
    server = create_server()
    register(server, registry)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await calls(adapters_pb2_grpc.AdaptersStub(channel))
    finally:
        await server.stop(None)


async def _list_and_get(stub) -> list:
    """The listing, after checking that a decoder's GetAdapter (with and without weights) of each
    listed adapter is refused with FAILED_PRECONDITION naming both base models."""
    listed = (await stub.ListAdapters(adapters_pb2.ListAdaptersRequest())).adapters
    for info in listed:
        for include_weights in (False, True):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetAdapter(adapters_pb2.GetAdapterRequest(name=info.name, include_weights=include_weights))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = refused.value.details()
            assert f"registered for base model {info.base_model_name} (base digest {info.base_model[:12]})" in details
            assert "this cluster serves base-b (llama, 2 layers, hidden 32)" in details and "replace=true" in details
    return list(listed)


def test_base_model_digest_covers_architecture_not_weights_or_context(tmp_path, base_model_dir, other_base):
    digest = base_model_digest(CheckpointConfig.read(base_model_dir))
    longer = _checkpoint(tmp_path / "longer", max_position_embeddings=4096)  # not an adapter's concern
    assert base_model_digest(CheckpointConfig.read(longer)) == digest and len(digest) == 64
    assert base_model_digest(CheckpointConfig.read(other_base)) != digest
    for change in ({"num_hidden_layers": 3}, {"hidden_size": 64}, {"num_key_value_heads": 4}):
        changed = _checkpoint(tmp_path / next(iter(change)), **change)
        assert base_model_digest(CheckpointConfig.read(changed)) != digest, change


def test_adapter_of_base_a_is_refused_by_a_registry_serving_base_b(root, adapter_in_root, base_model_dir,
                                                                   other_base, tmp_path):
    db = tmp_path / "catalog.sqlite3"
    on_a = _registry(root, db, base_model_dir)
    record = on_a.load("support", "plain")
    on_a.close()
    assert record.base_model == base_model_digest(CheckpointConfig.read(base_model_dir))
    assert record.base_model_name == f"{base_model_dir.name} (llama, 2 layers, hidden 32)"  # no architectures saved

    on_b = _registry(root, db, other_base)
    [info] = asyncio.run(_over_grpc(on_b, _list_and_get))
    assert (info.name, info.state, info.base_model) == ("support", "base_mismatch", record.base_model)
    assert info.base_model_name == record.base_model_name

    with pytest.raises(AlreadyExists, match="for another base model"):
        on_b.load("support", "plain")
    on_b.load("support", "plain", replace=True)  # registered again on B: servable there, refused on A
    assert on_b.get_admissible("support").base_model == base_model_digest(CheckpointConfig.read(other_base))
    on_b.close()
    with pytest.raises(FailedPrecondition, match=f"registered for base model {other_base.name}"):
        _registry(root, db, base_model_dir).get_admissible("support")


def test_catalog_without_base_column_is_migrated_and_its_rows_need_registering_again(
        root, adapter_in_root, base_model_dir, tmp_path):
    db = tmp_path / "old.sqlite3"
    with sqlite3.connect(db) as old:
        old.execute(OLD_SCHEMA)
        old.execute("INSERT INTO adapters VALUES (?,?,?,?,?,?,?,?,?,?)",
                    ("legacy", "plain", "ab" * 32, 4, 8.0, 0, json.dumps(["m"]), 3, "ready", 0.0))
    registry = _registry(root, db, base_model_dir)
    [status] = registry.list_status()
    assert (status.record.name, status.state, status.record.base_model) == ("legacy", "base_unknown", "")
    with pytest.raises(FailedPrecondition, match="registered before adapters recorded their base model"):
        registry.get_admissible("legacy")
    record = registry.load("legacy", "plain", replace=True)
    assert record.generation == 4 and registry.list_status()[0].state == "ready"
    registry.close()
    # a registry with no base configured checks nothing: the same row serves there too
    assert _registry(root, db, None).get_admissible("legacy").generation == 4


def test_up_gives_each_cluster_its_own_catalog(root, adapter_in_root, base_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "home"))
    base_model_dir = Path(shutil.copytree(base_model_dir, tmp_path / "base"))
    for name in ("model.safetensors", "tokenizer.json"):  # ClusterSpec checks a decoder dir has them; nothing reads them
        (base_model_dir / name).touch()
    registries = {}
    for name in ("alpha", "beta"):
        spec = ClusterSpec(cluster=name, decoder_model_dir=base_model_dir, embedding_model_dir=base_model_dir,
                           adapter_root=root)
        command = spec.command("adapters")
        assert command[command.index("--db") + 1] == str(tmp_path / "home/clusters" / name / "registry/catalog.sqlite3")
        config = parse_args(command[3:])  # the registry's own parser, as the process would run it
        assert config.db_path == spec.catalog_path
        registries[name] = AdapterRegistry(config)
    registries["alpha"].load("support", "plain")
    assert [r.name for r in registries["alpha"].list()] == ["support"]
    assert registries["beta"].list() == []
    registries["beta"].load("support", "plain")  # the same name in another cluster is another entry
    registries["alpha"].unload("support")
    assert [r.name for r in registries["beta"].list()] == ["support"] and registries["alpha"].list() == []
    for registry in registries.values():
        registry.close()
    shutil.rmtree(tmp_path / "home")
