"""Generate through the gateway equals transformers, alone and under concurrency."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from tessera.v1 import decoder_pb2

from .conftest import run_cli

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
]

MORE_PROMPTS = CHAT_PROMPTS + [
    "List three primary colors.",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "Name a planet in the solar system.",
]


def hf_greedy(hf_decoder, prompt: str, max_new_tokens: int) -> list[int]:
    model, tokenizer = hf_decoder
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def chat_request(prompt: str, max_tokens: int, **sampling) -> decoder_pb2.GenerateRequest:
    return decoder_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        messages=[decoder_pb2.ChatMessage(role="user", content=[decoder_pb2.ContentPart(text=prompt)])],
        sampling=decoder_pb2.SamplingParams(max_tokens=max_tokens, **sampling))


def collect(gateway, request) -> dict:
    ids, text, finish, usage = [], [], "", None
    for response in gateway.Generate(request, timeout=300):
        ids.extend(response.token_ids)
        text.append(response.text)
        if response.finish_reason:
            finish, usage = response.finish_reason, response.usage
    return {"ids": ids, "text": "".join(text), "finish": finish, "usage": usage}


def test_cli_generate_greedy_equals_transformers(gateway_address, hf_decoder):
    _, tokenizer = hf_decoder
    for prompt in CHAT_PROMPTS:
        expected = hf_greedy(hf_decoder, prompt, 32)
        result = run_cli(gateway_address, "generate", prompt, "--chat", "--max-tokens", "32", "--json")
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout)
        assert answer["token_ids"] == expected, prompt
        assert answer["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert answer["finish_reason"] == ("stop" if len(expected) < 32 else "length")
        usage = answer["usage"]
        assert usage["completion_tokens"] == len(expected)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_concurrent_streams_equal_solo(gateway):
    solo = [collect(gateway, chat_request(p, 32))["ids"] for p in MORE_PROMPTS]
    with ThreadPoolExecutor(len(MORE_PROMPTS)) as pool:
        together = list(pool.map(lambda p: collect(gateway, chat_request(p, 32))["ids"], MORE_PROMPTS))
    assert together == solo


def test_seeded_sampling_reproduces(gateway):
    first = collect(gateway, chat_request(CHAT_PROMPTS[1], 24, temperature=0.9, top_p=0.95, top_k=50, seed=1234))
    second = collect(gateway, chat_request(CHAT_PROMPTS[1], 24, temperature=0.9, top_p=0.95, top_k=50, seed=1234))
    assert first["ids"] == second["ids"] and len(first["ids"]) > 0


def test_stop_string_ends_generation(gateway, hf_decoder):
    _, tokenizer = hf_decoder
    full = tokenizer.decode(hf_greedy(hf_decoder, CHAT_PROMPTS[0], 16), skip_special_tokens=True)
    assert "Paris" in full
    result = collect(gateway, chat_request(CHAT_PROMPTS[0], 16, stop=["Paris"]))
    assert result["finish"] == "stop"
    assert result["text"] == full[: full.index("Paris")]


def test_cancelled_stream_leaves_service_healthy(gateway, assert_healthy):
    call = gateway.Generate(chat_request(CHAT_PROMPTS[1], 200, ignore_eos=True), timeout=300)
    next(iter(call))
    call.cancel()
    assert_healthy()
    assert collect(gateway, chat_request(CHAT_PROMPTS[0], 4))["finish"]


def test_raw_prompt_streams_text(gateway):
    request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text="The capital of France is")],
                                          sampling=decoder_pb2.SamplingParams(max_tokens=8))
    responses = list(gateway.Generate(request, timeout=300))
    assert len(responses) >= 2, "tokens should stream, not arrive as one message"
    assert responses[-1].finish_reason in ("stop", "length")
    assert responses[-1].usage.completion_tokens == sum(len(r.token_ids) for r in responses)


def test_deadline_is_honoured(gateway, assert_healthy):
    try:
        collect_with = list(gateway.Generate(chat_request(CHAT_PROMPTS[1], 500, ignore_eos=True), timeout=0.5))
        raise AssertionError(f"expected a deadline, got {len(collect_with)} messages")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_healthy()
