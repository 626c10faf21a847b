"""AdapterRegistry: generations, digests, persistence across restarts, on-disk change detection."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.adapters.config import RegistryConfig
from services.adapters.engine import AdapterRegistry
from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound


@pytest.fixture()
def config(root, base_model_dir):
    return RegistryConfig(root=root, admin_token="", base_model_dir=base_model_dir)


def _scale_b(directory, factor):
    path = directory / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[key] = tensors[key] * factor
    save_file(tensors, str(path))


def test_generation_and_digest_semantics(config, adapter_in_root, root):
    registry = AdapterRegistry(config)
    first = registry.load("support", "plain")
    assert (first.generation, first.state, first.path, first.rank) == (1, "ready", "plain", 4)
    assert len(first.digest) == 64 and len(first.targets) == 4
    with pytest.raises(AlreadyExists, match="replace"):
        registry.load("support", "plain")
    same = registry.load("support", str(adapter_in_root), replace=True)
    assert (same.generation, same.digest) == (2, first.digest)  # same files -> same digest
    twin = registry.load("twin", "plain")
    assert twin.digest == first.digest and twin.generation == 1
    _scale_b(adapter_in_root, 3.0)
    changed = registry.load("support", "plain", replace=True)
    assert changed.generation == 3 and changed.digest != first.digest
    # An alpha change alters effective weights, hence the digest, though tensors are identical.
    shutil.copytree(adapter_in_root, root / "alpha")
    cfg = (root / "alpha" / "adapter_config.json")
    cfg.write_text(cfg.read_text().replace('"lora_alpha": 8', '"lora_alpha": 16'))
    assert registry.load("alpha", "alpha").digest != changed.digest


def test_catalog_survives_restart(config, adapter_in_root):
    registry = AdapterRegistry(config)
    loaded = registry.load("support", "plain")
    registry.load("gone", "plain")
    registry.unload("gone")
    registry.close()
    restarted = AdapterRegistry(RegistryConfig(root=config.root, admin_token="", base_model_dir=config.base_model_dir))
    assert restarted.list() == [loaded]
    record, adapter = restarted.get_weights("support")
    assert record == loaded and adapter.digest == loaded.digest
    assert restarted.load("gone", "plain").generation == 2  # generations never repeat for a name


def test_weights_rechecked_against_digest(config, adapter_in_root):
    registry = AdapterRegistry(config)
    registry.load("support", "plain")
    _, adapter = registry.get_weights("support")
    expected = adapter.targets["model.layers.1.self_attn.v_proj"].lora_b
    _scale_b(adapter_in_root, 2.0)
    with pytest.raises(FailedPrecondition, match="adapter files changed since load; reload it"):
        registry.get_weights("support")
    assert registry.get("support").generation == 1  # metadata is still served
    reloaded = registry.load("support", "plain", replace=True)
    _, adapter = registry.get_weights("support")
    torch.testing.assert_close(adapter.targets["model.layers.1.self_attn.v_proj"].lora_b, expected * 2.0)
    assert reloaded.generation == 2
    shutil.rmtree(adapter_in_root)
    with pytest.raises(FailedPrecondition, match="reload it"):
        registry.get_weights("support")


def test_unknown_names_and_bad_loads(config, adapter_in_root, edit_adapter_config):
    registry = AdapterRegistry(config)
    with pytest.raises(NotFound, match="unknown adapter 'x'"):
        registry.get("x")
    with pytest.raises(NotFound, match="unknown adapter 'x'"):
        registry.unload("x")
    edit_adapter_config(adapter_in_root, use_dora=True)
    with pytest.raises(InvalidArgument, match="use_dora"):
        registry.load("dora", "plain")
    with pytest.raises(InvalidArgument, match="outside the adapter root"):
        registry.load("esc", "../x")
    assert registry.list() == []


def test_config_validation(root):
    with pytest.raises(ValueError, match="max_rank=0"):
        RegistryConfig(root=root, max_rank=0)
    with pytest.raises(ValueError, match="no config.json"):
        RegistryConfig(root=root, base_model_dir=root)
    assert RegistryConfig(root=root).db_path == root / "registry.sqlite3"


def test_unload_decides_on_counts_taken_after_the_call(config, adapter_in_root):
    """Lease counts arrive periodically, each counted before it was sent: the first report to
    arrive after an unload call may still show a request that finished before the call (deciding
    on it refused unloads wrongly under load), so the registry decides on the report after it,
    which the decoder counted once the first one's answer had arrived."""
    import asyncio
    import dataclasses

    registry = AdapterRegistry(dataclasses.replace(config, lease_confirm_s=30.0, drain_poll_s=0.01))
    try:
        digest = registry.load("a", adapter_in_root.name).digest
        leased = ({digest: 1}, {("a", digest): 1}, set())
        registry.report_residency("decoder-1", *leased)

        async def finished_meanwhile():
            unload = asyncio.ensure_future(registry.unload_async("a"))
            await asyncio.sleep(0.1)
            registry.report_residency("decoder-1", *leased)  # counted before the call, arriving after it
            await asyncio.sleep(0.1)
            assert not unload.done()
            registry.report_residency("decoder-1", {digest: 0}, {}, set())  # counted after the call
            await asyncio.wait_for(unload, 10)

        asyncio.run(finished_meanwhile())
        assert [r.name for r in registry.list()] == []

        registry.load("a", adapter_in_root.name)
        registry.report_residency("decoder-1", *leased)

        async def still_leased():
            unload = asyncio.ensure_future(registry.unload_async("a"))
            for _ in range(2):
                await asyncio.sleep(0.1)
                registry.report_residency("decoder-1", *leased)  # the second is counted after the call
            await asyncio.wait_for(unload, 10)                   # decided then, not at lease_confirm_s

        with pytest.raises(FailedPrecondition, match="leased by 1 running request"):
            asyncio.run(still_leased())
        assert [r.name for r in registry.list()] == ["a"]
    finally:
        registry.close()


def test_names_sharing_weights_are_leased_and_drained_separately(config, adapter_in_root):
    """Two names loaded from the same files share a digest; a request admitted as one neither
    blocks the unload of the other nor makes the other's drain wait or refuse it."""
    import asyncio
    import dataclasses

    registry = AdapterRegistry(dataclasses.replace(config, lease_confirm_s=1.0, drain_poll_s=0.01))
    try:
        digest = registry.load("alice", "plain").digest
        assert registry.load("bob", "plain").digest == digest
        report = {"resident": {digest: 1}, "leases": {("alice", digest): 1}}

        async def main():
            assert registry.report_residency("decoder-1", **report, draining_acked=set()) == []
            await registry.unload_async("bob")                  # only alice is leased
            registry.load("bob", "plain")
            drain = asyncio.ensure_future(registry.unload_async("bob", drain=True))
            await asyncio.sleep(0.05)
            assert registry.report_residency("decoder-1", **report, draining_acked=set()) == [("bob", digest)]
            registry.get_admissible("alice")                    # alice's admissions go on
            registry.report_residency("decoder-1", **report, draining_acked={("bob", digest)})
            await asyncio.wait_for(drain, 2)                    # without waiting for alice's request
            unload = asyncio.ensure_future(registry.unload_async("alice"))
            await asyncio.sleep(0.05)
            registry.report_residency("decoder-1", **report, draining_acked=set())
            with pytest.raises(FailedPrecondition, match="'alice' is leased by 1"):
                await unload

        asyncio.run(main())
        [status] = registry.list_status()
        assert (status.record.name, status.residency) == ("alice", (("decoder-1", 1),))
    finally:
        registry.close()


def test_restarted_registry_waits_for_reports_before_unloading(config, adapter_in_root):
    """After a restart the lease table is empty while decoders still run requests: an unload (or
    drain) right away must wait for their reports, not take the empty table as "unleased"."""
    import asyncio
    import dataclasses

    config = dataclasses.replace(config, lease_confirm_s=1.0, report_ttl_s=1.5, drain_poll_s=0.01)
    registry = AdapterRegistry(config)
    digest = registry.load("a", "plain").digest
    registry.close()
    restarted = AdapterRegistry(config)
    try:
        async def main():
            report = {"resident": {digest: 1}, "leases": {("a", digest): 1}, "draining_acked": set()}

            async def decoder():  # reports every 0.1 s, its first one 0.3 s after the restart
                await asyncio.sleep(0.3)
                while True:
                    restarted.report_residency("decoder-1", **report)
                    await asyncio.sleep(0.1)

            reporting = asyncio.ensure_future(decoder())
            unload = asyncio.ensure_future(restarted.unload_async("a"))
            drain = asyncio.ensure_future(restarted.unload_async("a", drain=True))
            with pytest.raises(FailedPrecondition, match="leased by 1"):
                await unload
            assert not drain.done()
            report.update(resident={digest: 0}, leases={}, draining_acked={("a", digest)})  # the request ends
            await asyncio.wait_for(drain, 3)
            reporting.cancel()

        asyncio.run(main())
        assert restarted.list() == []
    finally:
        restarted.close()
