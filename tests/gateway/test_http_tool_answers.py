"""tool_choice "auto" answers from scripted decoder messages (a decoder whose template takes tools,
parser "hermes"): each choice's text, cut into the pieces a decoder streams, is parsed on its own
(n = 2, different calls), the whole answer carries `tool_calls` (ids, type, arguments as JSON text),
content null when nothing else was said, finish_reason "tool_calls", and the stream has OpenAI's
delta shape, which the SDK's accumulator assembles into exactly the whole answer."""

from __future__ import annotations

import asyncio

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from services.gateway.http.app import create_app
from services.gateway.http.backend import Backend
from tessera.v1 import decoder_pb2, tensor_pb2

from .http_gateway import FakeGateway, Harness

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
# Per choice: the text a model wrote, in the pieces its tokens arrive in.
CHOICES = [
    ["<tool", "_call>\n{\"name\": \"get_", "weather\", \"arguments\": {\"city\": \"Par", "is\"}}\n</tool_call>",
     "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": 9}}\n</tool_", "call>"],
    ["Let me check. ", "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>"],
]
BODY = {"model": "base-model", "messages": [{"role": "user", "content": "weather and time?"}], "tools": TOOLS,
        "n": 2}


class ToolGateway(FakeGateway):
    """A decoder whose template takes tools (parser hermes), answering each choice with CHOICES."""

    async def info(self, call):
        info = await super().info(call)
        info.decoder.chat_template_takes_tools, info.decoder.tool_call_parser = True, "hermes"
        return info

    async def generate(self, request, call):
        self._record("Generate", request)
        for index in range(request.sampling.n):
            pieces = CHOICES[index]
            for i, piece in enumerate(pieces):
                message = decoder_pb2.GenerateResponse(index=index, token_ids=[100 + i], text=piece)
                if i == len(pieces) - 1:
                    message.finish_reason = "stop"
                    message.usage.CopyFrom(tensor_pb2.Usage(prompt_tokens=3, completion_tokens=len(pieces),
                                                            total_tokens=3 + len(pieces)))
                yield message


class ToolHarness(Harness):
    def __init__(self) -> None:
        self.gateway = ToolGateway()
        self.loop = asyncio.new_event_loop()
        self.app = create_app(Backend(self.gateway, {}), max_body_bytes=1 << 20)


@pytest.fixture
def harness():
    harness = ToolHarness()
    yield harness
    harness.close()


def test_auto_parses_each_choice_and_the_whole_answer_lists_the_calls(harness):
    status, answer = harness.post("/v1/chat/completions", BODY)
    assert status == 200, answer
    sent = harness.gateway.last("Generate")
    assert sent.tools and sent.sampling.WhichOneof("constraint") is None  # auto: rendered, parsed, not constrained
    first, second = answer["choices"]
    assert first["message"]["content"] is None and first["finish_reason"] == "tool_calls"
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in first["message"]["tool_calls"]] \
        == [("function", "get_weather", '{"city": "Paris"}'), ("function", "get_time", '{"zone": 9}')]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in first["message"]["tool_calls"])
    assert second["message"]["content"] == "Let me check. " and second["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in second["message"]["tool_calls"]] == ["get_time"]


def test_the_stream_has_openais_tool_call_deltas_and_the_sdk_assembles_the_whole_answer(harness):
    events = harness.stream("/v1/chat/completions", BODY)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"][0]["index"] == 0]
    assert deltas[0] == {"role": "assistant", "content": None}
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}} and calls[2]["index"] == 1
    assert not any("content" in d for d in deltas[1:])  # choice 0 said nothing besides its calls
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    streamed = state.current_completion_snapshot
    _, whole = harness.post("/v1/chat/completions", BODY)
    for got, want in zip(streamed.choices, whole["choices"], strict=True):
        assert got.message.content == want["message"]["content"] and got.finish_reason == want["finish_reason"]
        assert [(c.type, c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
            (c["type"], c["function"]["name"], c["function"]["arguments"]) for c in want["message"]["tool_calls"]]


def test_without_parallel_calls_a_choice_keeps_its_first(harness):
    _, answer = harness.post("/v1/chat/completions", {**BODY, "parallel_tool_calls": False})
    assert [c["function"]["name"] for c in answer["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    events = harness.stream("/v1/chat/completions", {**BODY, "parallel_tool_calls": False})
    indices = {d["tool_calls"][0]["index"] for e in events for d in [e["choices"][0]["delta"]] if "tool_calls" in d}
    assert indices == {0}


def test_none_parses_nothing_and_answers_the_text(harness):
    _, answer = harness.post("/v1/chat/completions", {**BODY, "tool_choice": "none"})
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "".join(CHOICES[0])}
    assert answer["choices"][0]["finish_reason"] == "stop"
