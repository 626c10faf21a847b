"""The decoder's side of tool calling (services/decoder/tools.py): a request's tools checked and
refused INVALID_ARGUMENT naming the entry; assistant tool calls as the template reads them; what a
template does with tools (SmolLM2's: nothing; a Hermes-style one: renders them, "hermes" parser)
and --tool-call-parser's override; tools apply to chat messages only."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from services.common.errors import InvalidArgument
from services.decoder.config import DecoderConfig
from services.decoder.convert import generate_from_pb
from services.decoder.multimodal import check_chat_options
from services.decoder.tools import (
    MAX_TOOLS,
    choose_tool_call_parser,
    parse_tools,
    template_takes_tools,
    template_tool_calls,
    tool_call_from_parts,
)
from tessera.paths import default_decoder_dir
from tessera.v1 import decoder_pb2
from tests.decoder.decoder_testing import HERMES_TEMPLATE

TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"},
                                         "strict": True}}


def test_a_valid_tool_list_is_kept_as_sent():
    assert parse_tools("") == ()
    assert parse_tools(json.dumps([TOOL, {"type": "function", "function": {"name": "g"}}])) == (
        TOOL, {"type": "function", "function": {"name": "g"}})


@pytest.mark.parametrize("tools, field, words", [
    ("{not json", "tools", "not JSON"),
    ('[{"type": "function", "function": {"name": "f", "parameters": NaN}}]', "tools", "NaN"),
    (json.dumps(TOOL), "tools", "JSON array"),
    (json.dumps([TOOL] * (MAX_TOOLS + 1)), "tools", f"limit is {MAX_TOOLS}"),
    (json.dumps([5]), "tools[0]", "object"),
    (json.dumps([{"type": "custom", "function": {"name": "f"}}]), "tools[0].type", '"function"'),
    (json.dumps([{**TOOL, "extra": 1}]), "tools[0].extra", "unknown key"),
    (json.dumps([{"type": "function"}]), "tools[0].function", "object"),
    (json.dumps([{"type": "function", "function": {"name": ""}}]), "tools[0].function.name", "non-empty"),
    (json.dumps([{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "tools[0].function.parameters", "JSON Schema object"),
    (json.dumps([{"type": "function", "function": {"name": "f", "bogus": 1}}]), "tools[0].function.bogus",
     "unknown key"),
])
def test_bad_tools_are_refused_naming_the_entry(tools, field, words):
    with pytest.raises(InvalidArgument, match=words) as refused:
        parse_tools(tools)
    assert refused.value.field == field


def test_tool_calls_reach_the_template_as_transformers_documents_them():
    call = tool_call_from_parts("c1", "f", '{"b": 1, "a": [2]}', "messages[0].tool_calls[0]")
    assert template_tool_calls((call,)) == [{"type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": [2]}},
                                             "id": "c1"}]
    assert list(template_tool_calls((call,))[0]["function"]["arguments"]) == ["b", "a"]  # the order sent
    for arguments, words in (("[1]", "JSON object"), ("{x", "not JSON"), ('"s"', "JSON object")):
        with pytest.raises(InvalidArgument, match=words) as refused:
            tool_call_from_parts("c", "f", arguments, "messages[2].tool_calls[1]")
        assert refused.value.field == "messages[2].tool_calls[1].arguments"


def test_what_a_template_does_with_tools_and_the_flag_that_overrides_the_parser():
    smollm = AutoTokenizer.from_pretrained(default_decoder_dir()).chat_template
    assert not template_takes_tools(smollm) and choose_tool_call_parser(smollm) == ""
    assert template_takes_tools(HERMES_TEMPLATE) and choose_tool_call_parser(HERMES_TEMPLATE) == "hermes"
    assert choose_tool_call_parser(HERMES_TEMPLATE, "none") == ""
    assert choose_tool_call_parser(smollm, "hermes") == "hermes"
    assert template_takes_tools({"default": smollm, "tool_use": HERMES_TEMPLATE})  # named templates
    with pytest.raises(ValueError, match="--tool-call-parser"):
        DecoderConfig(model_dir=str(default_decoder_dir()), tool_call_parser="mistral")


def test_tools_apply_to_messages_only_and_bad_calls_in_the_history_are_refused():
    tools = json.dumps([TOOL])
    text = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text="hi")], tools=tools)
    request = generate_from_pb(text)
    with pytest.raises(InvalidArgument, match="messages only"):
        check_chat_options(False, request.chat)
    history = decoder_pb2.GenerateRequest(tools=tools, messages=[decoder_pb2.ChatMessage(
        role="assistant", tool_calls=[decoder_pb2.ToolCall(id="c", name="f", arguments="[]")])])
    with pytest.raises(InvalidArgument) as refused:
        generate_from_pb(history)
    assert refused.value.field == "messages[0].tool_calls[0].arguments"
    ok = generate_from_pb(decoder_pb2.GenerateRequest(tools=tools, messages=[
        decoder_pb2.ChatMessage(role="tool", tool_call_id="c", content=[decoder_pb2.ContentPart(text="18 C")])]))
    assert ok.chat.tools == (TOOL,) and ok.messages[0].tool_call_id == "c"
