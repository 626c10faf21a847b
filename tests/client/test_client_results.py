"""The typed results and requests: an adapter's base model; max_tokens None (the rest of the
context: 0 on the wire); sampling fields always sent; a request's usage over its n choices;
OpenAI-style chat content parts."""

from __future__ import annotations

import base64
import json
import re

import pytest

from tessera.client import convert
from tessera.client.convert import ResultBuilder
from tessera.client.types import AdapterInfo, Message, SamplingParams, Usage
from tessera.v1 import adapters_pb2, decoder_pb2, tensor_pb2


def test_adapter_info_carries_its_base_model():
    message = adapters_pb2.AdapterInfo(name="support", state="base_mismatch", base_model="ab" * 32,
                                       base_model_name="SmolLM2-135M (LlamaForCausalLM, 30 layers, hidden 576)")
    info = convert.from_pb(AdapterInfo, message)
    assert (info.name, info.state, info.base_model) == ("support", "base_mismatch", "ab" * 32)
    assert info.base_model_name == message.base_model_name


def test_max_tokens_none_asks_for_the_rest_of_the_context():
    assert convert.sampling_params(SamplingParams(max_tokens=None)).max_tokens == 0
    assert convert.sampling_params(SamplingParams()).max_tokens == 64
    assert convert.sampling_params(SamplingParams(max_tokens=5)).max_tokens == 5


def _response(index: int, text: str, token_ids: list[int], finish: str = "", usage: tensor_pb2.Usage | None = None):
    response = decoder_pb2.GenerateResponse(request_id="r", index=index, text=text, token_ids=token_ids,
                                            finish_reason=finish)
    if usage is not None:
        response.usage.CopyFrom(usage)
    return response


def test_usage_sums_every_choices_completion_tokens_and_counts_the_prompt_once():
    # n = 3, choices finishing out of order; each final message carries that choice's own usage
    builder = ResultBuilder("r")
    for response in [
        _response(0, "a", [1]), _response(2, "x", [7]), _response(1, "p", [4]),
        _response(2, "y", [8], "length", tensor_pb2.Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7,
                                                          image_tokens=1)),
        _response(0, "b", [2, 3], "stop", tensor_pb2.Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8,
                                                           image_tokens=1, cached_prompt_tokens=4)),
        _response(1, "", [], "stop", tensor_pb2.Usage(prompt_tokens=5, completion_tokens=1, total_tokens=6,
                                                      image_tokens=1, cached_prompt_tokens=5)),
    ]:
        builder.add(response)
    result = builder.result()
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in result.choices] == [
        (0, "ab", [1, 2, 3], "stop"), (1, "p", [4], "stop"), (2, "xy", [7, 8], "length")]
    assert result.usage == Usage(prompt_tokens=5, completion_tokens=6, total_tokens=11, image_tokens=1,
                                 cached_prompt_tokens=4)  # choice 0 computed the prompt
    assert result.usage.completion_tokens == sum(len(c.token_ids) for c in result.choices)


def test_one_choice_keeps_its_usage_and_no_usage_is_zero():
    builder = ResultBuilder("r")
    builder.add(_response(0, "hi", [5, 6], "length", tensor_pb2.Usage(prompt_tokens=3, completion_tokens=2,
                                                                         total_tokens=5)))
    assert builder.result().usage == Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    assert ResultBuilder("r").result().usage == Usage()


def test_sampling_fields_are_always_sent_so_the_models_defaults_never_replace_the_clients():
    """temperature, top_p, top_k and repetition_penalty are proto3 `optional` (unset = the model's
    generation config); the client sends its own values, 0.0 included."""
    sampling = convert.sampling_params(SamplingParams())
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "min_p", "skip_special_tokens"):
        assert sampling.HasField(name), name
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty) == (0.0, 1.0, 0, 1.0)


def test_vllm_sampling_extras_reach_the_wire():
    sampling = convert.sampling_params(SamplingParams(min_p=0.2, min_tokens=3, include_stop_str_in_output=True,
                                                      skip_special_tokens=False))
    assert (round(sampling.min_p, 6), sampling.min_tokens) == (0.2, 3)
    assert sampling.include_stop_str_in_output and not sampling.skip_special_tokens


def test_token_controls_reach_the_wire():
    sampling = convert.sampling_params(SamplingParams(logit_bias={7: -100.0, 9: 2.5}, allowed_token_ids=(7, 8, 9),
                                                      bad_words=("cat", "big dog")))
    assert dict(sampling.logit_bias) == {7: -100.0, 9: 2.5}
    assert (list(sampling.allowed_token_ids), list(sampling.bad_words)) == ([7, 8, 9], ["cat", "big dog"])
    plain = convert.sampling_params(SamplingParams())
    assert (dict(plain.logit_bias), list(plain.allowed_token_ids), list(plain.bad_words)) == ({}, [], [])


PNG_URI = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()


def test_chat_takes_openai_content_parts_as_well_as_its_own():
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {"url": PNG_URI}},
                                             {"type": "image_url", "image_url": {"url": PNG_URI, "detail": "auto"}},
                                             "and", b"raw-bytes"]}]
    request = convert.generate_request(messages=messages, sampling=SamplingParams())
    parts = request.messages[0].content
    assert [p.WhichOneof("part") for p in parts] == ["text", "image", "image", "text", "image"]
    assert parts[0].text == "hi" and parts[3].text == "and"
    assert parts[1].image.data_uri == PNG_URI and parts[2].image.data_uri == PNG_URI  # vision decodes it
    assert parts[4].image.data == b"raw-bytes"
    ours = convert.generate_request(messages=[Message("user", ["hi", b"raw-bytes"])], sampling=SamplingParams())
    assert [p.WhichOneof("part") for p in ours.messages[0].content] == ["text", "image"]


@pytest.mark.parametrize(("part", "words"), [
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "content part type 'input_audio'"),
    ({"type": "file", "file": {}}, "content part type 'file'"),
    ({"text": "no type"}, "content part type None"),
    ({"type": "text", "text": "hi", "cache_control": {}}, "no field 'cache_control'"),
    ({"type": "text", "text": 3}, "text as a str"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote URLs are not fetched"),
    ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}, '"image_url": {"url"'),
    ({"type": "image_url", "image_url": {"url": PNG_URI, "detail": "high"}}, "detail 'high' is not honoured"),
    ({"type": "image_url", "image_url": {"url": PNG_URI, "size": 3}}, "no field 'size'"),
])
def test_an_openai_content_part_tessera_cannot_honour_is_refused_naming_it(part, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        convert.generate_request(messages=[{"role": "user", "content": [part]}], sampling=SamplingParams())


def test_a_messages_name_reaches_the_protobuf():
    messages = [{"role": "user", "content": "x", "name": "bob", "tool_calls": [], "refusal": None},
                Message("assistant", "hi", name="ada"), Message("user", "again")]
    request = convert.generate_request(messages=messages, sampling=SamplingParams())
    assert [(m.role, m.name) for m in request.messages] == [("user", "bob"), ("assistant", "ada"), ("user", "")]
    assert convert.tokenize_request(None, messages=messages[:1], model="", add_special_tokens=None,
                                    prompt_name="").messages[0].name == "bob"


def test_tool_calls_tool_answers_and_tools_reach_the_protobuf():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    request = convert.generate_request(messages=messages, sampling=SamplingParams(), tools=tools)
    assert json.loads(request.tools) == tools
    [call] = request.messages[1].tool_calls
    assert (call.id, call.name, call.arguments) == ("c1", "f", '{"a": 1}')
    assert request.messages[1].content[0].text == "" and request.messages[2].tool_call_id == "c1"
    with pytest.raises(ValueError, match="tools go with chat messages"):
        convert.generate_request(prompt="x", sampling=SamplingParams(), tools=tools)


@pytest.mark.parametrize(("message", "words"), [
    ({"role": "user", "content": "x", "bogus": 1}, "messages[0] has no field 'bogus'"),
    ({"role": "assistant", "content": "x", "tool_calls": [{"id": "1", "type": "function"}]},
     "messages[0].tool_calls[0] must be"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f"}}, "messages[0].function_call is not "
                                                                              "supported"),
    ({"role": "assistant", "content": "x", "reasoning_content": "hmm"}, "messages[0].reasoning_content is not supported"),
    ({"role": "user"}, "messages[0].content is missing"),
    ({"role": "user", "content": None}, "messages[0].content is missing"),
    ({"content": "x"}, "messages[0].role must be a str"),
    ({"role": "user", "content": "x", "name": 3}, "messages[0].name must be a str"),
    (Message("user", None), "messages[0].content is missing"),
])
def test_a_message_key_tessera_does_not_take_is_refused_naming_it(message, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        convert.generate_request(messages=[message], sampling=SamplingParams())
