"""One registry, two decoder replicas (engines with their own bank and decoder id): an adapter
loaded once serves on both. Registry restart: killed while a request is in flight, that request
completes, a resident adapter keeps serving while it is down, and after a restart on the same
SQLite catalog ListAdapters shows the catalog and the decoders' residency reports again.
"""

import asyncio
import time

import grpc
import pytest
from lora_mixed_cases import registry_weights
from lora_registry_cases import (
    assert_nothing_leaked,
    generate,
    load_request,
    make_engine,
    peft_ids,
    run,
    save_all_adapters,
    start_registry,
)

from services.common.errors import NotFound, Unavailable
from services.decoder.adapter_client import RegistryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine import LLMEngine
from services.decoder.servicer import DecoderServicer
from tessera.v1 import adapters_pb2, adapters_pb2_grpc


@pytest.fixture(scope="module")
def root(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    save_all_adapters(tiny_llama, root)
    return root


async def _list(address):
    async with grpc.aio.insecure_channel(address) as channel:
        return (await adapters_pb2_grpc.AdaptersStub(channel).ListAdapters(adapters_pb2.ListAdaptersRequest())).adapters


def test_adapter_loaded_once_serves_on_two_replicas(tiny_llama, root, tmp_path):
    ref = peft_ids(tiny_llama, root / "rs8")
    registry = start_registry(tiny_llama, root, tmp_path / "catalog.sqlite3")
    replicas = [make_engine(tiny_llama, registry.address, slots=2) for _ in range(2)]

    async def main():
        async with grpc.aio.insecure_channel(registry.address) as channel:
            await adapters_pb2_grpc.AdaptersStub(channel).LoadAdapter(load_request("shared", "rs8"))
        ids = await asyncio.gather(*(generate(e, "shared") for e in replicas))
        for engine in replicas:
            await engine.adapters.report_once()
        return ids, await _list(registry.address)

    try:
        ids, listed = run(main())
        assert ids == [ref, ref]
        [info] = listed
        assert sorted(r.decoder_id for r in info.residency) == sorted(e.adapters.decoder_id for e in replicas)
        assert info.leases == 0
        for engine in replicas:
            assert engine.adapters.num_weight_fetches == 1
            assert_nothing_leaked(engine)
    finally:
        for engine in replicas:
            run(engine.adapters.close())
            engine.shutdown()
        registry.stop()


def test_registry_restart_fails_no_request_and_resident_adapters_keep_serving(tiny_llama, root, tmp_path):
    ref, ref_long = peft_ids(tiny_llama, root / "plain4"), peft_ids(tiny_llama, root / "plain4", new_tokens=48)
    db = tmp_path / "catalog.sqlite3"
    registry = start_registry(tiny_llama, root, db)
    address = registry.address
    engine = make_engine(tiny_llama, address, slots=2)

    async def in_flight_across_kill():
        """A long request for "a": the registry is SIGKILLed after its first token."""
        request = asyncio.ensure_future(generate(engine, "a", new_tokens=48))
        while not engine.stats().num_running:
            await asyncio.sleep(0.005)
        registry.process.kill()
        registry.process.wait()
        return await request

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = adapters_pb2_grpc.AdaptersStub(channel)
            info = await stub.LoadAdapter(load_request("a", "plain4"))
            await stub.LoadAdapter(load_request("never-used", "rs8"))
            await stub.LoadAdapter(load_request("gone", "plain4"))  # a's files: the weights stay resident
            assert await generate(engine, "gone") == ref
            await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="gone"))
        with pytest.raises(NotFound):
            await generate(engine, "gone")
        assert await generate(engine, "a") == ref
        long_ids = await in_flight_across_kill()
        down_ids = await asyncio.gather(*(generate(engine, "a") for _ in range(3)))
        with pytest.raises(Unavailable, match="unavailable"):
            await generate(engine, "never-used")      # neither resident nor in host memory
        with pytest.raises(Unavailable, match="unavailable"):
            await generate(engine, "gone")            # unloaded: not served from its last resolution
        restarted = start_registry(tiny_llama, root, db, address)
        deadline = time.monotonic() + 30
        while True:
            listed = await _list(address)
            residents = {a.name: [r.decoder_id for r in a.residency] for a in listed}
            if residents.get("a") == [engine.adapters.decoder_id] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        after_ids = await generate(engine, "a")
        return info, long_ids, down_ids, listed, residents, after_ids, restarted

    restarted = None
    try:
        info, long_ids, down_ids, listed, residents, after_ids, restarted = run(main())
        assert long_ids == ref_long and down_ids == [ref] * 3
        assert {(a.name, a.digest) for a in listed} >= {("a", info.digest)}
        assert sorted(a.name for a in listed) == ["a", "never-used"]
        assert residents["a"] == [engine.adapters.decoder_id]   # re-reported after the restart
        assert after_ids == ref
        assert_nothing_leaked(engine)
    finally:
        run(engine.adapters.close())
        engine.shutdown()
        for service in (registry, restarted):
            if service is not None:
                service.stop()


def test_decoder_service_reports_residency_from_start(tiny_llama, root, tmp_path):
    """engine.start() starts the residency reports: weights made resident without any request
    (so no acquire ever ran) show up in the registry's ListAdapters under this decoder's id."""
    registry = start_registry(tiny_llama, root, tmp_path / "catalog.sqlite3")
    config = DecoderConfig(model_dir=str(tiny_llama), num_blocks=16, max_model_len=128, adapter_slots=1,
                           max_lora_rank=16, adapters_address=registry.address)
    servicer = DecoderServicer(LLMEngine(config, RegistryAdapterSource.from_config(config)))

    async def main():
        async with grpc.aio.insecure_channel(registry.address) as channel:
            await adapters_pb2_grpc.AdaptersStub(channel).LoadAdapter(load_request("pre", "pattern16"))
        await servicer.engine.start()
        try:
            servicer.engine.adapters.report_interval_s = 0.05
            servicer.engine.parts.bank.load(registry_weights(tiny_llama, root, "pattern16"))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                [info] = await _list(registry.address)
                if info.residency:
                    return [r.decoder_id for r in info.residency], servicer.engine.adapters.decoder_id
                await asyncio.sleep(0.05)
            return [], servicer.engine.adapters.decoder_id
        finally:
            await servicer.engine.stop()

    try:
        reported, decoder_id = run(main())
        assert reported == [decoder_id]
    finally:
        registry.stop()
