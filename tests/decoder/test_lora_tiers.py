"""Host-memory tier and slot reuse against a registry process and an in-process engine.

More adapters than slots serve concurrent requests (admission waits for a slot, swap-ins come
from the host cache, not the registry); a slot that held an all-targets adapter, reused by a
q/v-only adapter, computes exactly its cold run; N+1 load/unload cycles on N slots leak nothing.
"""

import asyncio

import grpc
import pytest
import torch
from decoder_testing import capture_logits
from lora_mixed_cases import ADAPTERS
from lora_registry_cases import (
    PROMPT,
    assert_nothing_leaked,
    generate,
    load_request,
    make_engine,
    peft_ids,
    run,
    save_all_adapters,
    save_variant,
    start_registry,
)

from services.decoder.lora import AdapterSlots, HostAdapterCache, LoRAWeights
from tessera.v1 import adapters_pb2, adapters_pb2_grpc

PROMPTS = [PROMPT, list(range(100, 117))]


@pytest.fixture(scope="module")
def registry(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    save_all_adapters(tiny_llama, root)
    for i in range(3):
        save_variant(root, "plain4", f"var{i}", 1.0 + 0.25 * (i + 1))
    service = start_registry(tiny_llama, root, root / "registry.sqlite3")
    try:
        yield service.address, root
    finally:
        service.stop()


def test_three_adapters_on_two_slots_all_complete_equal_to_peft(tiny_llama, registry):
    address, root = registry
    refs = {(name, i): peft_ids(tiny_llama, root / name, p) for name in ADAPTERS for i, p in enumerate(PROMPTS)}
    engine = make_engine(tiny_llama, address, slots=2)

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = adapters_pb2_grpc.AdaptersStub(channel)
            for name in ADAPTERS:
                await stub.LoadAdapter(load_request(f"t-{name}", name))
            jobs = [(name, i) for i in range(len(PROMPTS)) for name in ADAPTERS]
            first = await asyncio.gather(*(generate(engine, f"t-{n}", PROMPTS[i]) for n, i in jobs))
            fetches = engine.adapters.num_weight_fetches
            second = await asyncio.gather(*(generate(engine, f"t-{n}", PROMPTS[i]) for n, i in jobs))
            await engine.adapters.report_once()
            for name in ADAPTERS:
                await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name=f"t-{name}"))
            return jobs, first, second, fetches

    try:
        jobs, first, second, fetches = run(main())
        assert first == [refs[j] for j in jobs] and second == first
        assert engine.adapters.num_slot_waits >= 1             # the third adapter waited for a slot
        assert fetches == 3 and engine.adapters.num_weight_fetches == 3  # swap-ins came from host memory
        assert len(engine.adapters.host_cache) == 3 and len(engine.parts.bank.residency()) == 2
        assert engine.adapters.host_cache.max_bytes == engine.config.adapter_host_cache_mb << 20
        assert_nothing_leaked(engine)
    finally:
        run(engine.adapters.close())
        engine.shutdown()


def test_slot_reuse_equals_cold_run_and_n_plus_one_cycles_leak_nothing(tiny_llama, registry):
    address, root = registry
    ref_all, ref_qv = peft_ids(tiny_llama, root / "plain4"), peft_ids(tiny_llama, root / "qv8")
    assert ref_all != ref_qv
    cold = make_engine(tiny_llama, address, slots=1)
    warm = make_engine(tiny_llama, address, slots=2)
    cold_logits, warm_logits = capture_logits(cold), capture_logits(warm)

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = adapters_pb2_grpc.AdaptersStub(channel)
            all_digest = (await stub.LoadAdapter(load_request("r-all", "plain4"))).digest
            qv_digest = (await stub.LoadAdapter(load_request("r-qv", "qv8"))).digest
            cold_ids = await generate(cold, "r-qv", request_id="qv")
            assert await generate(warm, "r-all", request_id="all") == ref_all
            await warm.adapters.report_once()
            await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="r-all"))
            warm.parts.bank.load(LoRAWeights("filler", {}))             # occupy slot 1: q/v must reuse slot 0
            assert warm.parts.bank.slot_of(all_digest) == 0
            warm_ids = await generate(warm, "r-qv", request_id="qv")
            assert warm.parts.bank.slot_of(qv_digest) == 0 and warm.parts.bank.slot_of(all_digest) is None
            await cold.adapters.report_once()
            await warm.adapters.report_once()
            await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="r-qv"))

            for i in range(3):                                    # N + 1 = 3 cycles on N = 2 slots
                await stub.LoadAdapter(load_request(f"cycle-{i}", f"var{i}"))
                assert len(await generate(warm, f"cycle-{i}")) == len(ref_all)
                await warm.adapters.report_once()
                await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name=f"cycle-{i}"))
            await stub.LoadAdapter(load_request("final", "plain4"))
            final = await generate(warm, "final")
            await warm.adapters.report_once()
            listed = (await stub.ListAdapters(adapters_pb2.ListAdaptersRequest())).adapters
            await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="final"))
            return cold_ids, warm_ids, final, listed

    try:
        cold_ids, warm_ids, final, listed = run(main())
        assert cold_ids == ref_qv and warm_ids == cold_ids
        assert torch.equal(torch.stack(warm_logits["qv"]), torch.stack(cold_logits["qv"]))  # no stale A/B rows
        assert final == ref_all
        assert [(a.name, a.leases) for a in listed] == [("final", 0)]
        assert len(warm.parts.bank.residency()) <= 2 and len(warm.adapters.host_cache) == 5
        assert warm.adapters.num_weight_fetches == 5  # "final" has plain4's digest: taken from host memory
        assert_nothing_leaked(warm)
    finally:
        for engine in (cold, warm):
            run(engine.adapters.close())
            engine.shutdown()


def test_bank_waiter_is_woken_by_the_release_that_frees_a_slot():
    bank = AdapterSlots(num_slots=1, max_rank=2, module_shapes={"m.q": (2, 2)})
    weights = lambda d: LoRAWeights(d, {"m.q": (torch.ones(1, 2), torch.ones(2, 1))})
    assert not bank.when_slot_frees(lambda: None)           # a slot is empty: nothing to wait for
    slot = bank.load_and_acquire(weights("a"))
    assert bank.load_and_acquire(weights("a")) == slot and bank.num_leases(slot) == 2
    assert bank.load_and_acquire(weights("b")) is None      # every slot leased
    woken = []
    assert bank.when_slot_frees(lambda: woken.append(1))
    bank.release(slot)
    assert woken == []                                      # still leased once
    bank.release(slot)
    assert woken == [1] and bank.load_and_acquire(weights("b")) == slot


def test_host_cache_is_bounded_lru_by_digest():
    w = lambda d: LoRAWeights(d, {"m": (torch.zeros(2, 4), torch.zeros(4, 2))})  # 64 bytes
    cache = HostAdapterCache(max_bytes=128)
    cache.put(w("a"))
    cache.put(w("b"))
    assert cache.get("a") is not None                       # a is now most recent
    cache.put(w("c"))
    assert "b" not in cache and "a" in cache and "c" in cache and cache.num_bytes == 128
    HostAdapterCache(0).put(w("x"))
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        HostAdapterCache(-1)


def test_host_cache_size_flag_reaches_the_adapter_client(tiny_llama):
    from services.decoder.__main__ import parse_args
    from services.decoder.config import DecoderConfig

    config = parse_args(["--model-dir", str(tiny_llama), "--adapter-host-cache-mb", "3"])
    assert config.adapter_host_cache_mb == 3
    with pytest.raises(ValueError, match="adapter_host_cache_mb must be >= 0, got -1"):
        DecoderConfig(model_dir=str(tiny_llama), adapter_host_cache_mb=-1)
