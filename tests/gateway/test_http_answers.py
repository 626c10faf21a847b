"""The answers' shapes, from scripted decoder messages (tests/gateway/http_gateway.py): logprobs
as users read them (token text and bytes, text_offset, `logprobs: 0`, the `token_id:<id>` form),
echo (the prompt first, `max_tokens: 0`), vLLM's prompt_logprobs, and the event stream in OpenAI's
exact shape: against a recorded OpenAI-shape fixture and the official SDK's stream accumulator."""

from __future__ import annotations

import asyncio

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from .http_gateway import (
    BASE,
    GENERATED_TEXT,
    PROMPT_TEXT,
    TOKENS,
    FakeGateway,
    Harness,
    alternatives,
    logprob_of,
    prompt_rank,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}

# OpenAI's stream as its API reference documents it (a chat answer with stream_options.include_usage;
# tessera sends no system_fingerprint, which OpenAI's schema marks optional): a role event, content
# events, a finishing event with an empty delta, a usage event with no choices.
OPENAI_CHAT_STREAM = [
    {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": 1694268190, "model": "gpt-4o-mini",
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
     "usage": None},
    {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": 1694268190, "model": "gpt-4o-mini",
     "choices": [{"index": 0, "delta": {"content": "Hello"}, "logprobs": None, "finish_reason": None}], "usage": None},
    {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": 1694268190, "model": "gpt-4o-mini",
     "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}], "usage": None},
    {"id": "chatcmpl-123", "object": "chat.completion.chunk", "created": 1694268190, "model": "gpt-4o-mini",
     "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}},
]
OPENAI_COMPLETION_STREAM = [
    {"id": "cmpl-7iA7", "object": "text_completion", "created": 1690759702, "model": "gpt-3.5-turbo-instruct",
     "choices": [{"text": "This", "index": 0, "logprobs": None, "finish_reason": None}], "usage": None},
    {"id": "cmpl-7iA7", "object": "text_completion", "created": 1690759702, "model": "gpt-3.5-turbo-instruct",
     "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}], "usage": None},
    {"id": "cmpl-7iA7", "object": "text_completion", "created": 1690759702, "model": "gpt-3.5-turbo-instruct",
     "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}},
]


def skeleton(value):
    """The keys and nesting of a JSON value, its leaves reduced to their kind (null, text, number)."""
    if isinstance(value, dict):
        return {k: skeleton(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [skeleton(v) for v in value[:1]]
    return "null" if value is None else type(value).__name__.replace("int", "number").replace("float", "number")


def kind(event: dict) -> str:
    if not event["choices"]:
        return "usage"
    choice = event["choices"][0]
    if choice["finish_reason"]:
        return "finish"
    return "role" if "role" in choice.get("delta", {}) else "content"


@pytest.fixture
def harness():
    harness = Harness()
    yield harness
    harness.close()


def test_chat_stream_has_openais_shape_and_the_sdk_accumulates_it_to_the_whole_answer(harness):
    body = {**CHAT, "stream_options": {"include_usage": True}}
    events = harness.stream("/v1/chat/completions", body)
    assert [kind(e) for e in events] == ["role", *["content"] * (len(events) - 3), "finish", "usage"]
    expected = {kind(e): skeleton(e) for e in OPENAI_CHAT_STREAM}
    for event in events:
        assert skeleton(event) == expected[kind(event)], event
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == len(TOKENS)
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    final = state.get_final_completion()
    _, whole = harness.post("/v1/chat/completions", CHAT)
    assert final.choices[0].message.content == whole["choices"][0]["message"]["content"] == GENERATED_TEXT
    assert final.choices[0].finish_reason == whole["choices"][0]["finish_reason"]
    assert final.usage.completion_tokens == whole["usage"]["completion_tokens"]


def test_stream_with_logprobs_and_n_accumulates_per_choice(harness):
    body = {**CHAT, "n": 2, "logprobs": True, "top_logprobs": 1}
    events = harness.stream("/v1/chat/completions", body)
    assert all("usage" not in e for e in events)  # no include_usage: no usage key at all
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    final = state.get_final_completion()
    _, whole = harness.post("/v1/chat/completions", body)
    for streamed, answered in zip(final.choices, whole["choices"], strict=True):
        assert streamed.message.content == answered["message"]["content"]
        assert [t.token for t in streamed.logprobs.content] == [t["token"] for t in answered["logprobs"]["content"]]


def test_completion_stream_has_openais_shape(harness):
    events = harness.stream("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}})
    expected = {kind(e): skeleton(e) for e in OPENAI_COMPLETION_STREAM}
    assert [kind(e) for e in events][-2:] == ["finish", "usage"]
    for event in events:
        assert skeleton(event) == expected[kind(event)], event
    assert events[-2]["choices"][0]["text"] == "" and "".join(
        e["choices"][0]["text"] for e in events[:-1]) == GENERATED_TEXT


def test_continuous_usage_stats_put_the_usage_so_far_on_every_event(harness):
    events = harness.stream("/v1/chat/completions", {**CHAT, "stream_options": {"continuous_usage_stats": True}})
    assert harness.gateway.last("Generate").return_prompt  # the prompt's length comes with the first message
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["prompt_tokens"] == 3 for e in events)
    assert counts == sorted(counts) and counts[-1] == len(TOKENS)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and counts[0] == 0  # as vLLM's
    assert counts[1] == 1  # the first token's event


def test_chat_logprobs_carry_each_tokens_text_and_bytes(harness):
    _, answer = harness.post("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2})
    content = answer["choices"][0]["logprobs"]["content"]
    assert [(c["token"], bytes(c["bytes"])) for c in content] == [(t[1], t[2]) for t in TOKENS]
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == GENERATED_TEXT
    assert [c["logprob"] for c in content] == [logprob_of(t[0]) for t in TOKENS]
    assert [a["token"] for a in content[0]["top_logprobs"]] == [a.token for a in alternatives(2)]
    _, zero = harness.post("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 0})
    assert all(c["top_logprobs"] == [] for c in zero["choices"][0]["logprobs"]["content"])


def test_tokens_as_token_ids_from_the_gateways_flag_or_the_request():
    harness = Harness(return_tokens_as_token_ids=True)
    try:
        _, answer = harness.post("/v1/chat/completions", {**CHAT, "logprobs": True})
        assert [c["token"] for c in answer["choices"][0]["logprobs"]["content"]] == [
            f"token_id:{t[0]}" for t in TOKENS]
        _, text = harness.post("/v1/completions", {"prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": False})
        assert text["choices"][0]["logprobs"]["tokens"] == [t[1] for t in TOKENS]
    finally:
        harness.close()
    harness = Harness()
    try:
        _, text = harness.post("/v1/completions", {"prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": True})
        assert text["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t[0]}" for t in TOKENS]
        assert list(text["choices"][0]["logprobs"]["top_logprobs"][0]) == [f"token_id:{TOKENS[0][0]}", "token_id:30"]
    finally:
        harness.close()


def test_completion_logprobs_have_text_offsets_and_top_logprobs_by_text(harness):
    _, answer = harness.post("/v1/completions", {"prompt": "x", "logprobs": 2})
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [t[1] for t in TOKENS]
    assert logprobs["text_offset"] == [0, 4, 4]  # " caf", then é's two tokens start at its character
    first = logprobs["top_logprobs"][0]
    assert list(first) == [TOKENS[0][1], "alt0", "alt1"]  # the chosen token first, then the alternatives
    assert first[TOKENS[0][1]] == logprobs["token_logprobs"][0]
    _, zero = harness.post("/v1/completions", {"prompt": "x", "logprobs": 0})
    tops = zero["choices"][0]["logprobs"]["top_logprobs"]
    assert tops == [{t[1]: logprob_of(t[0])} for t in TOKENS]  # the chosen token's only, never {}


def test_echo_returns_the_prompt_and_its_logprobs_first(harness):
    _, answer = harness.post("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1})
    request = harness.gateway.last("Generate")
    assert request.return_prompt and request.sampling.prompt_logprobs == 1
    choice = answer["choices"][0]
    assert choice["text"] == PROMPT_TEXT + GENERATED_TEXT
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"][:3]) == PROMPT_TEXT
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:3] == [logprob_of(11), logprob_of(12)]
    assert logprobs["text_offset"] == [0, 3, 5, 7, 11, 11]
    assert [choice["text"][o] for o in logprobs["text_offset"][:4]] == ["T", " ", "a", " "]


def test_echo_with_max_tokens_0_returns_the_prompt_alone(harness):
    """lm-evaluation-harness's loglikelihood request (and OpenAI's legacy API): the prompt and its
    logprobs, no completion tokens."""
    status, answer = harness.post("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert status == 200 and harness.gateway.last("Generate").sampling.max_tokens == 1
    choice = answer["choices"][0]
    assert choice["text"] == PROMPT_TEXT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == 3 and answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == 3
    events = harness.stream("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 0})
    assert "".join(e["choices"][0]["text"] for e in events) == PROMPT_TEXT
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_vllms_prompt_logprobs_answer(harness):
    _, answer = harness.post("/v1/completions", {"prompt": "x", "prompt_logprobs": 1})
    prompt_logprobs = answer["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == 3
    assert list(prompt_logprobs[1]) == ["11", "30"]  # the prompt's token first, then the alternative
    # the prompt's token's rank is its place in the whole vocabulary, the decoder's (vLLM's, never null)
    assert prompt_logprobs[1]["11"] == {"logprob": logprob_of(11), "rank": prompt_rank(11), "decoded_token": " c"}
    assert prompt_logprobs[1]["30"]["rank"] == 1
    assert answer["choices"][0]["text"] == GENERATED_TEXT  # no echo: the prompt is not in the text
    _, chat = harness.post("/v1/chat/completions", {**CHAT, "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and list(chat["prompt_logprobs"][2]) == ["12"]


def test_chat_echo_prepends_the_last_assistant_message(harness):
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}],
            "echo": True, "continue_final_message": True}
    _, answer = harness.post("/v1/chat/completions", body)
    assert answer["choices"][0]["message"]["content"] == "Well," + GENERATED_TEXT
    events = harness.stream("/v1/chat/completions", body)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Well," + GENERATED_TEXT
    _, plain = harness.post("/v1/chat/completions", {**CHAT, "echo": True})  # the last message is the user's
    assert plain["choices"][0]["message"]["content"] == GENERATED_TEXT


def test_streamed_chat_echo_is_an_event_of_its_own_and_each_events_logprobs_cover_its_text(harness):
    """vLLM's stream: the role's event, the echoed text's (no logprobs, no tokens counted), then the
    generated text, each event's logprobs exactly its content's tokens."""
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}],
            "echo": True, "continue_final_message": True, "logprobs": True,
            "stream_options": {"continuous_usage_stats": True}}
    events = harness.stream("/v1/chat/completions", body)
    role, echo, *rest = [e for e in events if e["choices"]]
    assert echo["choices"][0]["delta"] == {"content": "Well,"} and echo["choices"][0]["logprobs"] is None
    assert role["usage"]["completion_tokens"] == echo["usage"]["completion_tokens"] == 0
    generated = [e for e in rest if e["choices"][0]["delta"].get("content")]
    assert "".join(e["choices"][0]["delta"]["content"] for e in generated) == GENERATED_TEXT
    for event in generated:  # a token's bytes may complete a character in a later event: compare the whole
        assert event["choices"][0]["logprobs"]["content"], event
    data = b"".join(bytes(c["bytes"]) for e in rest if e["choices"][0]["logprobs"]
                    for c in e["choices"][0]["logprobs"]["content"])
    assert data.decode() == GENERATED_TEXT


def test_request_id_names_the_answer(harness):
    _, chat = harness.post("/v1/chat/completions", {**CHAT, "request_id": "abc"})
    _, text = harness.post("/v1/completions", {"prompt": "x", "request_id": "abc"})
    assert (chat["id"], text["id"], chat["model"]) == ("chatcmpl-abc", "cmpl-abc", BASE)


def test_health_follows_the_gateways_own_grpc_health():
    """The HTTP /health reads the gateway's own grpc.health.v1 status in process: NOT_SERVING (from
    SIGTERM on, before the drain) is a 503 naming the gateway, as its gRPC port answers."""
    from grpc_health.v1 import health, health_pb2

    from services.gateway.http.backend import Backend, health_of

    async def scenario():
        status = health.aio.HealthServicer()
        backend = Backend(FakeGateway(), {}, gateway_health=health_of(status))
        verdicts = []
        for serving in (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING):
            await status.set("", serving)
            verdicts.append((await backend.health()).not_serving)
        return verdicts

    serving, stopping = asyncio.run(scenario())
    assert not [p for p in serving if p.startswith("gateway")], serving
    assert "gateway: gateway NOT_SERVING" in stopping, stopping
