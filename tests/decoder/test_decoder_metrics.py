"""The decoder's request metrics: lifecycle hooks timed on a fake clock, and adapter swap counters
of an in-process engine against a registry process, read as Prometheus reads them."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
from lora_registry_cases import generate, load_request, make_engine, run, save_all_adapters, start_registry
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import make_registry
from services.decoder.stats import DecoderStats
from tessera.v1 import adapters_pb2_grpc


def _values(collector) -> dict[tuple[str, tuple], float]:
    text = generate_latest(make_registry(collector)).decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _request(key: str, lora_name: str = "", num_prompt_tokens: int = 7, max_tokens: int = 16):
    return SimpleNamespace(key=key, lora_name=lora_name, num_prompt_tokens=num_prompt_tokens,
                           sampling=SimpleNamespace(max_tokens=max_tokens))


def test_hooks_time_each_phase_of_a_request_on_the_engine_clock():
    now = [0.0]
    stats = DecoderStats("m", clock=lambda: now[0])
    a, b = _request("a", "sql"), _request("b", "chat")
    stats.on_arrival([a, b])
    now[0] = 1.0
    scheduler = SimpleNamespace(running=[a], waiting=[b])
    stats.on_schedule(SimpleNamespace(scheduled=[SimpleNamespace(request=a)], preempted=[]), scheduler)
    assert (stats.lora.running, stats.lora.waiting) == (("sql",), ("chat",))
    for t in (2.0, 2.5, 3.25):  # first token at 2 s, then gaps of 0.5 s and 0.75 s
        now[0] = t
        stats.on_token(a)
    now[0] = 4.0
    stats.on_schedule(SimpleNamespace(scheduled=[SimpleNamespace(request=a)], preempted=[b, b]), scheduler)
    stats.on_finish(a, "length")
    assert stats.lora.running == ("sql",)  # b is still in the engine: the last step's snapshot stands
    stats.on_finish(b, "abort")
    assert (stats.lora.running, stats.lora.waiting) == ((), ())  # idle: no adapter in use
    values = _values(stats)
    assert values[("vllm:request_queue_time_seconds_count", ())] == 1  # a second scheduling is not a queue wait
    assert values[("vllm:request_queue_time_seconds_sum", ())] == 1.0
    assert values[("vllm:time_to_first_token_seconds_sum", ())] == 2.0
    assert values[("vllm:inter_token_latency_seconds_count", ())] == 2
    assert values[("vllm:inter_token_latency_seconds_sum", ())] == 1.25
    assert values[("vllm:e2e_request_latency_seconds_sum", ())] == 8.0  # both arrived at 0 s, left at 4 s
    assert values[("vllm:prompt_tokens_total", ())] == 7  # once, at the first token
    assert values[("vllm:generation_tokens_total", ())] == 3
    assert values[("vllm:num_preemptions_total", ())] == 2
    assert values[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert values[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1
    assert values[("vllm:e2e_request_latency_seconds_count", ())] == 2
    # per finished request (vLLM's panels "Request Prompt Length", "Requests Prefill and Decode Time", ...)
    assert values[("vllm:request_prompt_tokens_count", ())] == 2 and values[("vllm:request_prompt_tokens_sum", ())] == 14
    assert values[("vllm:request_generation_tokens_sum", ())] == 3  # b was aborted before its first token
    assert values[("vllm:request_generation_tokens_bucket", (("le", "2.0"),))] == 1  # b's 0 tokens
    assert values[("vllm:request_max_num_generation_tokens_sum", ())] == 32
    assert values[("vllm:request_prefill_time_seconds_count", ())] == 1  # b never reached the prefill
    assert values[("vllm:request_prefill_time_seconds_sum", ())] == 1.0  # scheduled at 1 s, first token at 2 s
    assert values[("vllm:request_decode_time_seconds_sum", ())] == 1.25  # first token at 2 s, last at 3.25 s
    assert values[("vllm:request_inference_time_seconds_sum", ())] == 2.25
    assert values[("vllm:request_time_per_output_token_seconds_sum", ())] == 0.625  # 1.25 s over 2 tokens


def test_adapter_swaps_and_host_tier_hits_on_one_slot(tiny_llama, tmp_path):
    """A, B, A on one slot: three swap-ins, two registry fetches, the third from host memory."""
    root = tmp_path / "root"
    save_all_adapters(tiny_llama, root)
    registry = start_registry(tiny_llama, root, tmp_path / "registry.sqlite3")
    engine = make_engine(tiny_llama, registry.address, slots=1)

    async def main():
        async with grpc.aio.insecure_channel(registry.address) as channel:
            stub = adapters_pb2_grpc.AdaptersStub(channel)
            for name in ("plain4", "rs8"):
                await stub.LoadAdapter(load_request(name, name))
        for name in ("plain4", "rs8", "plain4"):
            await generate(engine, name)

    try:
        run(main())
        values = _values(engine.collector())
        assert values[("tessera_adapter_swaps_total", ())] == 3
        assert values[("tessera_adapter_weight_fetches_total", ())] == 2
        assert values[("tessera_adapter_host_cache_hits_total", ())] == 1
        assert values[("vllm:request_success_total", (("finished_reason", "length"),))] == 3
        [info] = [labels for (name, labels) in values if name == "vllm:lora_requests_info"]
        assert dict(info) == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "1"}  # idle
    finally:
        run(engine.adapters.close())
        engine.shutdown()
        registry.stop()
