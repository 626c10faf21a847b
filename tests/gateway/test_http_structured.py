"""Structured output through the HTTP API (services/gateway/http/chat/structured.py).

Over the HTTP app and a recording core (http_gateway.Harness): every spelling (OpenAI's
response_format, vLLM's structured_outputs and guided_*) sets the one SamplingParams constraint it
names, compact JSON unless structured_outputs.disable_any_whitespace is false; a decoder's refusal
of the constraint names the body's field that carried it; two constraints, or options with none,
are refused before the core is called.

With the official `openai` SDK over real sockets, against a real decoder serving a tiny random
Qwen2 checkpoint (SmolLM2's tokenizer, a Hermes-style template): `parse` with a pydantic model,
json_object, json_schema, a regex, a choice, completions with n = 3, a streamed answer, tool_choice
"required" and a named function (streamed calls equal the whole answer for one seed), and the
refusals, after which the decoder holds nothing and still answers. Each schema bounds its strings,
numbers and arrays so a random model reaches the end of its JSON within max_tokens; strings are
bounded by a `pattern`, since xgrammar 0.2.9 compiles minLength/maxLength to a character class that
admits raw control characters (U+0000-U+001F but CR and LF), which a random model samples and no
JSON parser takes.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import grpc
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel, Field

from services.common.errors import InvalidArgument
from tessera.v1 import decoder_pb2, decoder_pb2_grpc
from tests.decoder.decoder_testing import HERMES_TEMPLATE, make_tiny_llama

from .http_gateway import Harness
from .live_gateway import LiveGateway
from .test_http_app import error_of

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Describe a pet."}]
BASES = {CHAT: {"messages": HI}, COMPLETIONS: {"prompt": "A pet:"}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
MODEL = "tiny"


class Pet(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z]{1,6}$")
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    tags: list[Annotated[str, Field(pattern=r"^[a-z ]{0,5}$")]] = Field(max_length=3)


PET_SCHEMA = Pet.model_json_schema()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                               "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


# -- the HTTP door: what reaches the protobuf -------------------------------------------------------

@pytest.fixture
def harness():
    harness = Harness()
    yield harness
    harness.close()


# (route, the body's fields, the oneof member set, its value, the field a refusal of it names)
SPELLINGS = [
    (CHAT, {"response_format": {"type": "json_object"}}, "json_object", True, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}},
     "json_schema", SCHEMA, "response_format.json_schema.schema"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "any", "strict": True}}},
     "json_object", True, "response_format.json_schema"),
    (CHAT, {"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA, "structured_outputs.json"),
    (CHAT, {"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", SCHEMA, "structured_outputs.json"),
    (CHAT, {"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+", "structured_outputs.regex"),
    (CHAT, {"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"], "structured_outputs.choice"),
    (CHAT, {"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"',
     "structured_outputs.grammar"),
    (CHAT, {"structured_outputs": {"json_object": True, "backend": "xgrammar"}}, "json_object", True,
     "structured_outputs.json_object"),
    (CHAT, {"guided_json": SCHEMA, "guided_decoding_backend": "auto"}, "json_schema", SCHEMA, "guided_json"),
    (CHAT, {"guided_regex": "[0-9]+"}, "regex", "[0-9]+", "guided_regex"),
    (CHAT, {"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"], "guided_choice"),
    (CHAT, {"guided_choice": []}, "choice", [], "guided_choice"),  # the decoder's to refuse, naming it
    (CHAT, {"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"', "guided_grammar"),
    (COMPLETIONS, {"response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}},
     "json_schema", SCHEMA, "response_format.json_schema.schema"),
    (COMPLETIONS, {"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+", "structured_outputs.regex"),
    (COMPLETIONS, {"guided_json": SCHEMA}, "json_schema", SCHEMA, "guided_json"),
]


def _constraint(sampling: decoder_pb2.SamplingParams):
    kind = sampling.WhichOneof("constraint")
    value = getattr(sampling, kind) if kind else None
    if kind == "choice":
        return kind, list(value.choices)
    return kind, json.loads(value) if kind == "json_schema" else value


@pytest.mark.parametrize("route, fields, kind, value, field", SPELLINGS)
def test_each_spelling_sets_the_constraint_it_names_compact_by_default(harness, route, fields, kind, value, field):
    status, answer = harness.post(route, {**BASES[route], **fields})
    assert status == 200, answer
    sampling = harness.gateway.last("Generate").sampling
    assert _constraint(sampling) == (kind, value)
    assert not sampling.any_whitespace


@pytest.mark.parametrize("route, fields, kind, value, field", SPELLINGS)
def test_a_decoder_refusal_of_the_constraint_names_the_bodys_field(harness, route, fields, kind, value, field):
    harness.gateway.refusal = InvalidArgument(f"{kind} uses 'uniqueItems' at #, which is not supported",
                                              field=f"sampling.{kind}")
    status, answer = harness.post(route, {**BASES[route], **fields})
    assert status == 400 and error_of(answer)["param"] == field, answer
    assert error_of(answer)["message"] == f"{field} uses 'uniqueItems' at #, which is not supported"


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_any_whitespace_only_when_disable_any_whitespace_is_sent_false(harness, route):
    for options, any_whitespace in (({"disable_any_whitespace": False}, True), ({"disable_any_whitespace": True}, False),
                                    ({"disable_any_whitespace": None}, False), ({}, False)):
        for constraint in ({"structured_outputs": {"json": SCHEMA, **options}},
                           {"response_format": {"type": "json_object"}, "structured_outputs": options or None}):
            status, answer = harness.post(route, {**BASES[route], **constraint})
            assert status == 200, (constraint, answer)
            sampling = harness.gateway.last("Generate").sampling
            assert sampling.WhichOneof("constraint") and sampling.any_whitespace is any_whitespace, constraint


@pytest.mark.parametrize("route, fields, param", [
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    (CHAT, {"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex"),
    (COMPLETIONS, {"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    (COMPLETIONS, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
                   "structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs.grammar"),
    (CHAT, {"structured_outputs": {"disable_any_whitespace": False}}, "structured_outputs"),
    (COMPLETIONS, {"structured_outputs": {"json_object": False}}, "structured_outputs"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces"}}},
     "response_format.json_schema.name"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "n" * 65}}},
     "response_format.json_schema.name"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format"),
    (CHAT, {"response_format": {"type": "structural_tag"}}, "response_format.type"),
    (CHAT, {"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    (CHAT, {"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a", "backend": "guidance"}}, "structured_outputs.backend"),
    (COMPLETIONS, {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    (CHAT, {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    (CHAT, {"guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern"),
    (CHAT, {"structural_tag": "{}"}, "structural_tag"),
    (CHAT, {"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"guided_regex": "a", "tools": TOOLS, "tool_choice": {"type": "function",
                                                                 "function": {"name": "get_time"}}}, "tool_choice"),
])
def test_refused_structured_fields_are_400_naming_them_before_the_core(harness, route, fields, param):
    status, answer = harness.post(route, {**BASES[route], **fields})
    assert status == 400 and error_of(answer)["param"] == param, answer
    if param == "tool_choice":
        assert "(response_format)" in error_of(answer)["message"] or "(guided_regex)" in error_of(answer)["message"]
    assert "Generate" not in harness.gateway.received


# -- a real decoder, through the openai SDK ---------------------------------------------------------

@pytest.fixture(scope="module")
def live(tmp_path_factory):
    directory = make_tiny_llama(tmp_path_factory.mktemp("structured"), seed=11, family="qwen2")
    (directory / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    with LiveGateway(directory, num_blocks=96, max_model_len=512, served_model_name=(MODEL,)) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def _chat(client, **request):
    return client.chat.completions.create(model=MODEL, messages=HI, temperature=1.0, **request)


def test_parse_with_a_pydantic_model_answers_an_instance(client):
    for seed in (1, 2):
        reply = client.chat.completions.parse(model=MODEL, messages=HI, response_format=Pet, max_tokens=200,
                                              temperature=1.0, seed=seed)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop" and isinstance(message.parsed, Pet), message
        jsonschema.validate(json.loads(message.content), PET_SCHEMA)
        assert message.parsed == Pet.model_validate_json(message.content)


def test_json_object_and_a_json_schema_sent_as_a_dict(client):
    # the random model writes long strings; a bias towards `"` (one token of SmolLM2's) ends them
    reply = _chat(client, response_format={"type": "json_object"}, max_tokens=100, seed=1, logit_bias={"18": 14})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    reply = _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}},
                  max_tokens=200, seed=3, n=2)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)


def test_a_regex_and_a_choice_in_vllms_spellings(client):
    pattern = r"[a-z]{3,8}-[0-9]{2}"
    reply = _chat(client, max_tokens=30, seed=4, n=2, extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.message.content) and c.finish_reason == "stop" for c in reply.choices), reply
    choices = ["yes", "no", "maybe later"]
    reply = _chat(client, max_tokens=30, seed=5, n=3, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in reply.choices), reply


def test_completions_take_structured_outputs_and_response_format(client):
    for extra in ({"structured_outputs": {"json": PET_SCHEMA}},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}}):
        reply = client.completions.create(model=MODEL, prompt="A pet:", max_tokens=200, temperature=1.0, seed=6, n=3,
                                          extra_body=extra)
        assert len(reply.choices) == 3
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.text), PET_SCHEMA)


def test_a_streamed_constrained_answer_is_the_whole_answer(client):
    request = dict(response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}},
                   max_tokens=200, seed=7)
    whole = _chat(client, **request).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in _chat(client, stream=True, **request)
                       if chunk.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PET_SCHEMA)


def _assembled(client, **request):
    state = ChatCompletionStreamState()
    for chunk in _chat(client, stream=True, **request):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


@pytest.mark.parametrize("tool_choice, parallel", [
    ("required", False), ("required", None), ({"type": "function", "function": {"name": "get_weather"}}, None)])
def test_tool_calls_follow_the_functions_parameters_streamed_or_whole(client, tool_choice, parallel):
    request = dict(tools=TOOLS, tool_choice=tool_choice, max_tokens=200, seed=8)
    if parallel is not None:
        request["parallel_tool_calls"] = parallel
    whole = _chat(client, **request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls, whole
    if parallel is False:
        assert len(whole.message.tool_calls) == 1
    for call in whole.message.tool_calls:
        if isinstance(tool_choice, dict):
            assert call.function.name == tool_choice["function"]["name"]
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    streamed = _assembled(client, **request).choices[0]
    assert streamed.finish_reason == whole.finish_reason
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def _decoder_info(live) -> decoder_pb2.DecoderInfo:
    with grpc.insecure_channel(live.decoder_address) as channel:
        return decoder_pb2_grpc.DecoderStub(channel).GetInfo(decoder_pb2.DecoderInfoRequest(), timeout=10)


def _refusal(call, *args, **kwargs) -> dict:
    """The body of the 400 that `call(*args, **kwargs)` is answered with."""
    with pytest.raises(openai.BadRequestError) as error:
        call(*args, **kwargs)
    return error.value.body


def test_refusals_name_the_bodys_field_and_leave_nothing_behind(live, client):
    before = _decoder_info(live)
    unique = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    body = _refusal(_chat, client, max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "tags", "schema": unique}})
    assert body["param"] == "response_format.json_schema.schema" and "'uniqueItems'" in body["message"], body
    assert "#/properties/tags" in body["message"]
    for extra, param in (({"guided_regex": "("}, "guided_regex"),
                         ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex")):
        body = _refusal(_chat, client, max_tokens=8, extra_body=extra)
        assert body["param"] == param and body["message"].startswith(f"{param} cannot be compiled"), body
        body = _refusal(client.completions.create, model=MODEL, prompt="x", max_tokens=8, extra_body=extra)
        assert body["param"] == param, body
    body = _refusal(_chat, client, max_tokens=8, response_format={"type": "json_object"},
                    extra_body={"guided_regex": "a+"})
    assert body["param"] == "guided_regex", body
    body = _refusal(_chat, client, max_tokens=8, extra_body={"guided_regex": "a+",
                                                             "guided_decoding_backend": "outlines"})
    assert body["param"] == "guided_decoding_backend" and "xgrammar" in body["message"], body
    body = _refusal(_chat, client, max_tokens=8, response_format={"type": "json_object"}, tools=TOOLS,
                    tool_choice="required")
    assert body["param"] == "tool_choice" and "response_format" in body["message"], body
    after = _decoder_info(live)
    assert (after.num_running, after.num_waiting, after.num_free_blocks) == (0, 0, before.num_free_blocks)
    reply = _chat(client, max_tokens=4, seed=9)
    assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
