"""Leases vs the registry over a real socket: a registry subprocess and an in-process engine.

Unload/replace of a leased adapter is FAILED_PRECONDITION; with drain=true new admissions are
refused and the call completes when the decoder reports zero leases. Reloading a name with new
weights gives a new digest, and the same prompt then follows the new weights (no stale prefix
cache hit), equal to PeftModel with the new adapter.
"""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from decoder_testing import hf_reference
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lora_mixed_cases import save_adapters
from peft import PeftModel
from transformers import LlamaForCausalLM

from services.common.errors import FailedPrecondition
from services.decoder.adapter_client import RegistryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.types import GenerateInput, SamplingParams
from tessera.v1 import adapters_pb2, adapters_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 5, 77, 300, 12, 9, 44, 8, 19, 250, 31, 7, 66, 90, 3, 17, 28]  # > one 16-token block
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def registry(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    save_adapters(tiny_llama, root)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    process = subprocess.Popen([sys.executable, "-m", "services.adapters", "--address", address, "--root", str(root),
                                "--base-model-dir", str(tiny_llama), "--max-rank", "16"], cwd=REPO,
                               env={**os.environ, "TESSERA_ADMIN_TOKEN": ""}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 30
            while True:
                assert process.poll() is None and time.monotonic() < deadline
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                        break
                except grpc.RpcError:
                    time.sleep(0.2)
        yield address, root
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=20)


def _peft_ids(model_dir, adapter_dir):
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(model_dir).eval(), adapter_dir).eval()
    return hf_reference(model, PROMPT, NEW_TOKENS)[0]


def _engine(model_dir, address):
    """An engine on the registry at `address`, reporting leases every 50 ms."""
    config = DecoderConfig(model_dir=str(model_dir), num_blocks=64, max_model_len=256, adapter_slots=2,
                           max_lora_rank=16, adapters_address=address)
    engine = start_engine(config, RegistryAdapterSource.from_config(config))
    engine.adapters.report_interval_s = 0.05
    return engine


async def _generate(engine, lora):
    request = GenerateInput(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), prompt_token_ids=tuple(PROMPT),
                            lora=lora)
    return [t async for out in engine.generate(request) for t in out.token_ids]


def test_leased_unload_refused_drain_waits_and_reload_follows_new_weights(tiny_llama, registry):
    address, root = registry
    refs = {name: _peft_ids(tiny_llama, root / name) for name in ("plain4", "rs8")}
    assert refs["plain4"] != refs["rs8"]
    engine = _engine(tiny_llama, address)

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = adapters_pb2_grpc.AdaptersStub(channel)
            first = await stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="a", path="plain4"))
            assert await _generate(engine, "a") == refs["plain4"]

            slot = await engine.adapters.acquire("a")        # the lease an admission takes
            await engine.adapters.report_once()
            [info] = (await stub.ListAdapters(adapters_pb2.ListAdaptersRequest())).adapters
            assert info.leases == 1 and [r.decoder_id for r in info.residency] == [engine.adapters.decoder_id]
            for call in (stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="a")),
                         stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="a", path="rs8", replace=True))):
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call
                assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "leased by 1 running request" in error.value.details()

            drain = asyncio.ensure_future(stub.LoadAdapter(
                adapters_pb2.LoadAdapterRequest(name="a", path="rs8", replace=True, drain=True)))
            while ("a", first.digest) not in engine.adapters.draining:
                await asyncio.sleep(0.02)
            with pytest.raises(FailedPrecondition, match="draining"):
                await _generate(engine, "a")                 # new admissions refused while draining
            [info] = (await stub.ListAdapters(adapters_pb2.ListAdaptersRequest())).adapters
            assert info.state == "draining" and not drain.done()
            await asyncio.sleep(0.3)
            assert not drain.done()                          # still leased: the replace waits
            engine.parts.bank.release(slot, "a")                   # the request finishes
            second = await asyncio.wait_for(drain, 10)
            assert second.digest != first.digest and second.generation == first.generation + 1

            assert await _generate(engine, "a") == refs["rs8"]  # new weights, no stale prefix-cache KV
            assert engine.stats().prefix_cache_hits == 0

            await engine.adapters.report_once()
            await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="a"))  # unleased: immediate
            assert not (await stub.ListAdapters(adapters_pb2.ListAdaptersRequest())).adapters
        await engine.adapters.close()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_names_sharing_weights_do_not_share_leases_or_drains(tiny_llama, registry):
    """"b" is loaded from "a"'s files (one digest, one bank slot): a request admitted as "a" does
    not block unloading "b", and draining "b" neither refuses "a" nor waits for its request."""
    address, _ = registry
    engine = _engine(tiny_llama, address)

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = adapters_pb2_grpc.AdaptersStub(channel)
            a = await stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="a", path="plain4"))
            b = await stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="b", path="plain4"))
            assert a.digest == b.digest
            expected = await _generate(engine, "b")
            slot = await engine.adapters.acquire("a")          # a running request admitted as "a"
            await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="b"))  # not refused
            await stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="b", path="plain4"))
            drain = asyncio.ensure_future(stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="b", drain=True)))
            while ("b", b.digest) not in engine.adapters.draining and not drain.done():
                await asyncio.sleep(0.02)
            assert await _generate(engine, "a") == expected    # "a" is admitted during b's drain
            await asyncio.wait_for(drain, 10)                  # while "a" still holds its lease
            listed = (await stub.ListAdapters(adapters_pb2.ListAdaptersRequest())).adapters
            assert [(info.name, info.leases) for info in listed] == [("a", 1)]
            engine.parts.bank.release(slot, "a")
            await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="a"))
        await engine.adapters.close()

    try:
        asyncio.run(main())
        assert set(engine.parts.bank.residency().values()) <= {0}
    finally:
        engine.shutdown()


def test_an_unloaded_adapter_leaves_resident_adapters(tiny_llama, registry):
    """DecoderInfo.resident_adapters (the gateway's adapter affinity reads it) follows the registry:
    a name unloaded there leaves it with the next report although its weights stay in the slot, a
    name loaded from the same files joins it without a request of its own."""
    address, _ = registry
    engine = _engine(tiny_llama, address)

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = adapters_pb2_grpc.AdaptersStub(channel)
            await stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="kept", path="plain4"))
            await _generate(engine, "kept")
            await engine.adapters.report_once()
            assert engine.info().resident_adapters == ["kept"]
            await stub.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="twin", path="plain4"))
            await engine.adapters.report_once()
            assert engine.info().resident_adapters == ["kept", "twin"]  # its weights are held already
            await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="kept"))
            await engine.adapters.report_once()
            assert engine.info().resident_adapters == ["twin"]
            assert set(engine.parts.bank.residency()) != set()  # the weights stay resident, for "twin"
            await stub.UnloadAdapter(adapters_pb2.UnloadAdapterRequest(name="twin"))
            await engine.adapters.report_once()
            assert engine.info().resident_adapters == []
            with pytest.raises(Exception, match="unknown adapter 'kept'"):
                await _generate(engine, "kept")
        await engine.adapters.close()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_reports_are_sequential_so_the_registry_can_date_their_counts(tiny_llama, registry):
    """The registry takes a report's counts as newer than an unload call only when the report
    before it arrived after the call (services/adapters/leases.py), which holds when a decoder
    counts after its previous report's answer: report_once calls and the periodic reports never
    overlap."""
    address, _ = registry
    engine = _engine(tiny_llama, address)
    source, call = engine.adapters, engine.adapters._call
    in_flight, most, sent = 0, 0, 0

    async def counted(method, request):
        nonlocal in_flight, most, sent
        if method != "ReportResidency":
            return await call(method, request)
        in_flight, sent = in_flight + 1, sent + 1
        most = max(most, in_flight)
        try:
            await asyncio.sleep(0.01)  # a report in flight long enough for the next one to start
            return await call(method, request)
        finally:
            in_flight -= 1

    source._call = counted

    async def main():
        source.start_reporting()                      # every 50 ms
        await asyncio.gather(*(source.report_once() for _ in range(4)))
        await asyncio.sleep(0.2)
        await source.close()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert sent >= 5 and most == 1
