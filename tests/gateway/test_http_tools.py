"""Tool calling through the HTTP API with the official `openai` SDK, over real sockets, against a
real decoder serving a tiny seeded checkpoint whose chat template takes tools (a Hermes-style
template, built here) and one whose template does not (SmolLM2's own).

- the stream, assembled by the SDK, equals the whole answer (greedy), calls included;
- `tool` messages and assistant `tool_calls` in the history render to the ids of transformers'
  `apply_chat_template(messages, tools=...)` (/tokenize, and the prompt's usage);
- refusals: "auto" on a template without tools, "auto" with --tool-call-parser none, a bad tools
  array, an unknown named function, tool_choice without tools, the legacy `functions`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from transformers import AutoTokenizer

from tessera.v1 import decoder_pb2, decoder_pb2_grpc
from tests.decoder.decoder_testing import HERMES_TEMPLATE, make_tiny_llama

from .live_gateway import LiveGateway

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                   "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time in Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call-2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 9}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call-2", "content": "21:04"},
]
MAX_TOKENS = 48
MODEL = "tiny"


def _template_messages(messages: list[dict]) -> list[dict]:
    """`messages` as transformers' tool-use convention has them: arguments as objects, null
    content as "" (as the gateway renders it)."""
    out = []
    for message in messages:
        entry = {**message, "content": message["content"] or ""}
        if "tool_calls" in message:
            entry["tool_calls"] = [{"type": "function", "id": c["id"],
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": json.loads(c["function"]["arguments"])}}
                                   for c in message["tool_calls"]]
        out.append(entry)
    return out


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory):
    directory = make_tiny_llama(tmp_path_factory.mktemp("hermes"), seed=11, family="qwen2")
    (directory / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def hermes(hermes_dir):
    with LiveGateway(hermes_dir, num_blocks=64, max_model_len=512, served_model_name=(MODEL,)) as live:
        yield live, openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """SmolLM2's own template, which takes no tools."""
    directory = make_tiny_llama(tmp_path_factory.mktemp("plain"), seed=3)
    with LiveGateway(directory, num_blocks=32, max_model_len=512, served_model_name=(MODEL,)) as live:
        yield live, openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _chat(client, **request):
    return client.chat.completions.create(model=MODEL, **request)


def _refusal(call) -> dict:
    with pytest.raises(openai.BadRequestError) as error:
        call()
    assert error.value.status_code == 400
    return error.value.body


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def _streamed(client, **request):
    state = ChatCompletionStreamState()
    for chunk in _chat(client, stream=True, **request):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot  # the SDK's assembly (get_final_completion refuses "length")


def test_the_decoder_reports_what_its_template_does_with_tools(hermes, plain):
    for (live, _), takes, parser in ((hermes, True, "hermes"), (plain, False, "")):
        with grpc.insecure_channel(live.decoder_address) as channel:
            info = decoder_pb2_grpc.DecoderStub(channel).GetInfo(decoder_pb2.DecoderInfoRequest(), timeout=10)
        assert (info.chat_template_takes_tools, info.tool_call_parser) == (takes, parser)


@pytest.mark.parametrize("tool_choice", ["none", "auto"])
def test_the_sdks_assembly_of_a_stream_equals_the_whole_answer(hermes, tool_choice):
    _, client = hermes
    request = dict(messages=HISTORY, tools=TOOLS, tool_choice=tool_choice, max_tokens=MAX_TOKENS * 3,
                   temperature=0)
    whole = _chat(client, **request).choices[0]
    streamed = _streamed(client, **request).choices[0]
    assert streamed.message.content == whole.message.content
    assert streamed.finish_reason == whole.finish_reason
    assert [(c.type, c.function.name, c.function.arguments) for c in streamed.message.tool_calls or ()] == [
        (c.type, c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    if tool_choice in ("required", "auto") or isinstance(tool_choice, dict):
        assert whole.message.tool_calls is not None  # tool answers always list their calls
    if tool_choice != "none" and tool_choice != "auto":
        assert whole.message.tool_calls and whole.finish_reason == "tool_calls"


def test_tool_messages_and_calls_render_as_transformers_renders_them(hermes, hermes_dir):
    live, client = hermes
    tokenizer = AutoTokenizer.from_pretrained(hermes_dir)
    expected = tokenizer.apply_chat_template(_template_messages(HISTORY), tools=TOOLS, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    status, answer = _post(f"{live.url}/tokenize", {"messages": HISTORY, "tools": TOOLS})
    assert status == 200 and answer["tokens"] == list(expected), answer
    text = tokenizer.decode(expected)
    assert '<tool_response id="call-2">' in text and '"zone": 9' in text and '"maxLength": 12' in text
    # the prompt a chat request is given is the same: its usage counts those tokens
    reply = _chat(client, messages=HISTORY, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert reply.usage.prompt_tokens == len(expected)
    _, without = _post(f"{live.url}/tokenize", {"messages": HISTORY})
    assert without["tokens"] == list(tokenizer.apply_chat_template(_template_messages(HISTORY),
                                                                   add_generation_prompt=True)["input_ids"])


def test_auto_on_a_template_without_tools_is_refused_naming_why(plain):
    _, client = plain
    body = _refusal(lambda: _chat(client, messages=ASK, tools=TOOLS, max_tokens=4))
    assert body["param"] == "tool_choice" and "template takes no `tools`" in body["message"], body
    body = _refusal(lambda: _chat(client, messages=ASK, tools=TOOLS, tool_choice="auto",
                                                           max_tokens=4))
    assert body["param"] == "tool_choice"
    # "none" asks for nothing it cannot do
    reply = _chat(client, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


def test_auto_without_a_parser_is_refused(hermes_dir):
    with LiveGateway(hermes_dir, num_blocks=16, max_model_len=256, tool_call_parser="none",
                     served_model_name=(MODEL,)) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        body = _refusal(lambda: _chat(client, messages=ASK, tools=TOOLS, max_tokens=4))
        assert body["param"] == "tool_choice" and "tool-call parser" in body["message"], body


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, None),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0.tool_call_id"),
])
def test_bad_tool_fields_are_400_naming_the_field(hermes, fields, param):
    live, _ = hermes
    status, answer = _post(f"{live.url}/v1/chat/completions", {"messages": ASK, "max_tokens": 2, **fields})
    if param is None:  # an empty list of calls asks for nothing
        assert status == 200, answer
        return
    assert status == 400 and answer["error"]["param"] == param, answer


def test_bad_tool_call_arguments_in_the_history_are_refused(hermes):
    live, _ = hermes
    history = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "[1, 2]"}}]}]
    status, answer = _post(f"{live.url}/v1/chat/completions", {"messages": history, "max_tokens": 2})
    assert status == 400 and "a JSON object" in answer["error"]["message"], answer
    assert answer["error"]["param"] == "messages.1.tool_calls.0.function.arguments", answer
