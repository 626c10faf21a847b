"""What a chat body's tool fields ask of the decoder (services/gateway/http/chat/tools.py): the
JSON schema of tool_choice "required" (vLLM's) accepts exactly arrays of calls whose arguments
validate (checked with jsonschema, $defs lifted to its root), a named function's is its
parameters, the tools reach the template only where it takes them, and the refusals."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.gateway.http.chat.protocol import ChatCompletionRequest
from services.gateway.http.chat.serving import chat_fields, chat_request
from services.gateway.http.chat.tools import DecoderTools, constraint, tool_plan
from services.gateway.http.errors import ApiError

POINT = {"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}}}
NOTHING = {"function": {"name": "stop"}, "type": "function"}  # keys in another order; no parameters
HERMES = DecoderTools(takes_tools=True, parser="hermes")
PLAIN = DecoderTools(takes_tools=False, parser="")


def _body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "go"}], **fields})


def _schema(body: ChatCompletionRequest, decoder=HERMES) -> dict:
    return json.loads(constraint(body, tool_plan(body, decoder)))


def test_required_accepts_exactly_arrays_of_valid_calls():
    schema = _schema(_body(tools=[POINT, NOTHING], tool_choice="required"))
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [[{"name": "move", "parameters": {"to": {"x": 1}}}],
             [{"name": "stop", "parameters": {}}, {"name": "move", "parameters": {"to": {"x": -3}}}]]
    invalid = [[], [{"name": "move", "parameters": {"to": {"x": "1"}}}], [{"name": "fly", "parameters": {}}],
               [{"name": "move"}], {"name": "stop", "parameters": {}}]
    for value in valid:
        jsonschema.validate(value, schema)
    for value in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    single = _schema(_body(tools=[POINT, NOTHING], tool_choice="required", parallel_tool_calls=False))
    jsonschema.validate(valid[0], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(valid[1], single)


def test_a_named_function_is_held_to_its_parameters():
    assert _schema(_body(tools=[POINT, NOTHING], tool_choice={"type": "function", "function": {"name": "move"}})) == \
        POINT["function"]["parameters"]
    assert _schema(_body(tools=[POINT, NOTHING], tool_choice={"type": "function", "function": {"name": "stop"}})) == \
        {"type": "object", "properties": {}}


def test_tools_reach_the_template_as_sent_only_where_it_takes_them():
    body = _body(tools=[POINT, NOTHING], tool_choice="required")
    rendered = chat_request(body, plan=tool_plan(body, HERMES), decoder=HERMES)
    assert json.loads(rendered.tools) == [POINT, NOTHING]
    assert list(json.loads(rendered.tools)[1]) == ["function", "type"]  # the order sent (the template's tojson)
    assert rendered.sampling.WhichOneof("constraint") == "json_schema"
    unrendered = chat_request(body, plan=tool_plan(body, PLAIN), decoder=PLAIN)
    assert unrendered.tools == "" and unrendered.sampling.json_schema == rendered.sampling.json_schema
    auto = _body(tools=[NOTHING])
    request = chat_request(auto, plan=tool_plan(auto, HERMES), decoder=HERMES)
    assert request.tools and request.sampling.WhichOneof("constraint") is None  # auto: parsed, not constrained
    none = _body(tools=[NOTHING], tool_choice="none")
    assert chat_request(none, plan=tool_plan(none, HERMES), decoder=HERMES).tools  # rendered, as vLLM


@pytest.mark.parametrize("fields, decoder, param, words", [
    ({"tools": [NOTHING]}, PLAIN, "tool_choice", "template takes no `tools`"),
    ({"tools": [NOTHING], "tool_choice": "auto"}, DecoderTools(True, ""), "tool_choice", "tool-call parser"),
    ({"tools": [NOTHING], "tool_choice": {"type": "function", "function": {"name": "go"}}}, HERMES,
     "tool_choice.function.name", "'go'"),
    ({"tool_choice": "required"}, HERMES, "tool_choice", "needs tools"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "go"}}}, HERMES, "tool_choice",
     "needs tools"),
])
def test_refusals_name_the_field_and_why(fields, decoder, param, words):
    with pytest.raises(ApiError) as refused:
        tool_plan(_body(**fields), decoder)
    assert refused.value.param == param and words in refused.value.message


def test_no_tools_asks_for_nothing():
    for fields in ({}, {"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"parallel_tool_calls": False}):
        assert tool_plan(_body(**fields), None) is None


def test_two_tools_defining_one_def_differently_are_refused():
    other = json.loads(json.dumps(POINT))
    other["function"]["name"] = "jump"
    other["function"]["parameters"]["$defs"]["point"]["required"] = []
    body = _body(tools=[POINT, other], tool_choice="required")
    with pytest.raises(ApiError) as refused:
        constraint(body, tool_plan(body, HERMES))
    assert refused.value.param == "tools.1.function.parameters"


def test_a_refusal_of_the_constraint_names_the_tools():
    named = {"type": "function", "function": {"name": "stop"}}
    assert chat_fields(_body(tools=[POINT, NOTHING], tool_choice=named))["sampling.json_schema"] == \
        "tools.1.function.parameters"
    assert chat_fields(_body(tools=[POINT], tool_choice="required"))["sampling.json_schema"] == "tools"
    assert "sampling.json_schema" not in chat_fields(_body(tools=[POINT]))
