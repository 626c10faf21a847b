"""Every field a client sends is honoured, accepted or refused by name, never dropped
(services/gateway/http/fields.py): a property test over every request body (a field outside the
table, at any level, is 400 naming its dotted path; the fields inside it pass; each refused field
is 400 naming it unless its value asks for nothing), and each honoured field reaches the protobuf
the gateway's gRPC API receives (tests/gateway/http_gateway.py's FakeGateway records it)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument
from services.gateway.http.app import REQUEST_BODIES
from services.gateway.http.chat import protocol as chat_protocol
from services.gateway.http.chat import structured
from services.gateway.http.fields import Strict, is_accepted
from services.gateway.http.models import protocol as models_protocol
from services.gateway.http.pooling import protocol as pooling_protocol
from services.gateway.http.tei import protocol as tei_protocol
from services.gateway.http.tokenize import protocol as tokenize_protocol
from tessera.v1 import pooling_pb2

from .http_gateway import ALIASES, BASE, EMBEDDER, EMBEDDER_ALIAS, GENERATED_TEXT, GENERATION_DEFAULTS, Harness
from .test_http_app import App, call, error_of, tei_error_of

IMAGE = "data:image/png;base64,iVBORw0KGgo="
MESSAGE = {"role": "user", "content": [{"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}},
                                       {"type": "image_url", "image_url": {"url": IMAGE}}]}

# Per route: a valid body, and the model of each object inside it (by its path in the body).
ROUTES = {
    "/v1/chat/completions": ({"model": "m", "messages": [MESSAGE], "stream": True,
                              "stream_options": {"include_usage": True},
                              "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}},
                              "structured_outputs": {"disable_any_whitespace": False}},
                             {(): chat_protocol.ChatCompletionRequest, ("messages", 0): chat_protocol.ChatMessage,
                              ("messages", 0, "content", 0): chat_protocol.TextPart,
                              ("messages", 0, "content", 1): chat_protocol.ImagePart,
                              ("messages", 0, "content", 1, "image_url"): chat_protocol.ImageURL,
                              ("stream_options",): chat_protocol.StreamOptions,
                              ("response_format",): structured.ResponseFormat,
                              ("response_format", "json_schema"): structured.JsonSchemaFormat,
                              ("structured_outputs",): structured.StructuredOutputs}),
    "/v1/completions": ({"model": "m", "prompt": "x", "stream": True, "stream_options": {},
                         "structured_outputs": {"regex": "a+"}},
                        {(): chat_protocol.CompletionRequest, ("stream_options",): chat_protocol.StreamOptions,
                         ("structured_outputs",): structured.StructuredOutputs}),
    "/v1/embeddings": ({"model": "m", "input": "x"}, {(): pooling_protocol.EmbeddingRequest}),
    "/v1/rerank": ({"query": "q", "documents": [{"text": "d"}]},
                   {(): pooling_protocol.RerankRequest, ("documents", 0): pooling_protocol.RerankRequestDocument}),
    "/v1/score": ({"text_1": "a", "text_2": "b"}, {(): pooling_protocol.ScoreRequest}),
    "/tokenize": ({"messages": [MESSAGE]}, {(): tokenize_protocol.TokenizeRequest, ("messages", 0): chat_protocol.ChatMessage,
                                            ("messages", 0, "content", 0): chat_protocol.TextPart,
                                            ("messages", 0, "content", 1): chat_protocol.ImagePart,
                                            ("messages", 0, "content", 1, "image_url"): chat_protocol.ImageURL}),
    "/detokenize": ({"tokens": [1]}, {(): tokenize_protocol.DetokenizeRequest}),
    "/embed": ({"inputs": "x"}, {(): tei_protocol.TeiEmbedRequest}),
    "/v1/load_lora_adapter": ({"lora_name": "a", "lora_path": "p"}, {(): models_protocol.LoadLoraAdapterRequest}),
    "/v1/unload_lora_adapter": ({"lora_name": "a"}, {(): models_protocol.UnloadLoraAdapterRequest}),
}
TEI_ROUTES = {"/embed"}


def _strict_models() -> set[type[Strict]]:
    return {model for _, objects in ROUTES.values() for model in objects.values()}


def _declared(model: type[Strict]) -> dict:
    """A model's declared fields by the name a body gives them (a field's alias: `schema`, `json`)."""
    return {info.alias or name: info for name, info in model.model_fields.items()}


# Every name any body declares or refuses: a name outside it is unknown at every level.
KNOWN = {name for model in _strict_models() for name in (*_declared(model), *model.refused)}
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4),
                           lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner,
                                                                                       max_size=2), max_leaves=4)


def _at(body: dict, path: tuple) -> dict:
    for part in path:
        body = body[part]
    return body


def _copy(body: dict) -> dict:
    return json.loads(json.dumps(body))


@pytest.fixture(scope="module")
def app():
    app = App(max_body_bytes=1 << 20)  # nothing listens behind it: an accepted body answers 503
    yield app
    app.close()


def test_the_routes_cover_every_request_body():
    assert set(REQUEST_BODIES.values()) <= _strict_models()
    for model in _strict_models():
        assert model.model_config.get("extra") == "forbid", model


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data(), name=st.from_regex(r"\A[a-z][a-z_]{0,14}\Z").filter(lambda n: n not in KNOWN),
       value=JSON_VALUES)
def test_an_unknown_field_at_any_level_is_400_naming_its_path(app, data, name, value):
    route = data.draw(st.sampled_from(sorted(ROUTES)))
    template, objects = ROUTES[route]
    path = data.draw(st.sampled_from(sorted(objects, key=len)))
    body = _copy(template)
    _at(body, path)[name] = value
    status, answer = call(app, route, json.dumps(body).encode())
    dotted = ".".join(str(p) for p in (*path, name))
    assert status == 400, (route, body, answer)
    if route in TEI_ROUTES:
        assert dotted in tei_error_of(answer)["error"]
    else:
        assert error_of(answer)["param"] == dotted, (route, body, answer)
        assert "not a field of this request" in error_of(answer)["message"]


def _paths(value, prefix=()) -> list[tuple]:
    """Every key and index path of a JSON value."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return [path for key, inner in items for path in ((*prefix, key), *_paths(inner, (*prefix, key)))]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data(), value=JSON_VALUES)
def test_any_value_anywhere_is_answered_never_a_500(app, data, value):
    route = data.draw(st.sampled_from(sorted(ROUTES)))
    body = _copy(ROUTES[route][0])
    *parent, last = data.draw(st.sampled_from(_paths(body)))
    _at(body, tuple(parent))[last] = value
    status, answer = call(app, route, json.dumps(body).encode())
    assert status in (400, 503), (route, body, answer)  # refused, or on to the (unreachable) gateway


def _refused() -> list[tuple[str, tuple, str]]:
    return sorted({(route, path, name) for route, (_, objects) in ROUTES.items()
                   for path, model in objects.items() for name in model.refused}, key=str)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_a_refused_field_is_400_naming_it_unless_its_value_asks_for_nothing(app, data):
    route, path, name = data.draw(st.sampled_from(_refused()))
    template, objects = ROUTES[route]
    rule = objects[path].refused[name]
    body = _copy(template)
    target = _at(body, path)
    value = data.draw(JSON_VALUES.filter(lambda v: not rule.permits(v, target)))
    target[name] = value
    status, answer = call(app, route, json.dumps(body).encode())
    dotted = ".".join(str(p) for p in (*path, name))
    assert status == 400, (route, body, answer)
    message = tei_error_of(answer)["error"] if route in TEI_ROUTES else error_of(answer)["message"]
    assert message.startswith(f"{dotted} is not supported: {rule.reason}"), answer
    if route not in TEI_ROUTES:
        assert error_of(answer)["param"] == dotted
    target[name] = data.draw(st.sampled_from([None, *rule.allowed]))
    assert call(app, route, json.dumps(body).encode())[0] != 400, (route, body)


@pytest.mark.parametrize("content", [["x", 5], [{"text": "x"}], [{"type": 5}], [None], 5, {"type": "text"}])
def test_malformed_content_is_400_naming_it(app, content):
    body = {"messages": [{"role": "user", "content": content}]}
    status, answer = call(app, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and error_of(answer)["param"].startswith("messages.0.content"), answer


# A value for each declared field of chat and completions: together (a subset of them) the body is
# valid; `_compatible` settles the pairs that depend on each other.
CHAT_EXAMPLES = {
    "model": "m", "messages": [MESSAGE, {"role": "assistant", "content": "It is"}], "max_tokens": 5,
    "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2, "temperature": 0.5, "top_p": 0.9,
    "stop": ["x"], "seed": 1, "n": 2, "presence_penalty": 0.1, "frequency_penalty": 0.1, "stream": False,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False},
    "user": "u", "metadata": {"k": "v"}, "parallel_tool_calls": False, "safety_identifier": "s",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"},
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 1, "stop_token_ids": [2],
    "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "logit_bias": {"7": -100, "42": 2.5}, "allowed_token_ids": [7, 8, 9], "bad_words": ["cat", "big dog"],
    "prompt_logprobs": 1, "return_tokens_as_token_ids": True, "request_id": "r1", "echo": True,
    "add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False},
    "documents": [{"title": "t", "text": "x"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
    "response_format": {"type": "json_schema", "json_schema": {"name": "n", "description": "d", "strict": True,
                                                               "schema": {"type": "object"}}},
    "structured_outputs": {"json": {"type": "array"}, "disable_any_whitespace": False, "disable_fallback": True,
                           "backend": "xgrammar", "disable_additional_properties": False},
    "guided_json": '{"type": "string"}', "guided_regex": "[a-z]+", "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "a"'}
# the fields that state an output constraint: a body takes one (tool_choice above is one too)
CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")
COMPLETION_EXAMPLES = {
    **{k: v for k, v in CHAT_EXAMPLES.items() if k in chat_protocol.SamplingFields.model_fields},
    "prompt": ["a", "b"], "max_tokens": 0, "logprobs": 2, "echo": True}


def _compatible(body: dict) -> dict:
    stated = [name for name in CONSTRAINTS if name in body]
    for name in stated[1:] if "tool_choice" not in body else stated:
        body.pop(name)
    if "tool_choice" in body:
        body["tools"] = CHAT_EXAMPLES["tools"]
    if "stream_options" in body:
        body["stream"] = True
        body.pop("prompt_logprobs", None)
    if "top_logprobs" in body:
        body["logprobs"] = True
    if body.get("max_tokens") == 0:
        body["echo"] = True
    return body


@pytest.mark.parametrize("model, examples", [(chat_protocol.ChatCompletionRequest, CHAT_EXAMPLES),
                                             (chat_protocol.CompletionRequest, COMPLETION_EXAMPLES)])
def test_every_declared_field_has_an_example(model, examples):
    assert set(examples) == set(_declared(model))


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_the_fields_of_the_table_are_accepted(app, data):
    route, examples, required = data.draw(st.sampled_from([
        ("/v1/chat/completions", CHAT_EXAMPLES, ("messages",)), ("/v1/completions", COMPLETION_EXAMPLES, ("prompt",))]))
    chosen = data.draw(st.sets(st.sampled_from(sorted(examples))))
    body = _compatible({name: examples[name] for name in {*chosen, *required}})
    status, answer = call(app, route, json.dumps(body).encode())
    assert status == 503, (body, answer)  # past validation, on to the (unreachable) gateway


@pytest.fixture
def harness():
    harness = Harness()
    yield harness
    harness.close()


def test_every_honoured_sampling_field_reaches_the_protobuf(harness):
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "top_p": 0.9, "top_k": 5,
            "min_p": 0.1, "repetition_penalty": 1.3, "seed": 7, "stop": "x", "stop_token_ids": [2, 3], "n": 2,
            "presence_penalty": 0.25, "frequency_penalty": 0.5, "ignore_eos": True, "min_tokens": 2,
            "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
            "logprobs": True, "top_logprobs": 3, "prompt_logprobs": 2, "max_completion_tokens": 3}
    assert harness.post("/v1/chat/completions", body)[0] == 200
    sampling = harness.gateway.last("Generate").sampling
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        assert sampling.HasField(name) and getattr(sampling, name) == pytest.approx(body[name]), name
    for name in ("presence_penalty", "frequency_penalty"):
        assert getattr(sampling, name) == pytest.approx(body[name]), name
    assert (sampling.top_k, sampling.seed, list(sampling.stop), list(sampling.stop_token_ids), sampling.n) == (
        5, 7, ["x"], [2, 3], 2)
    assert (sampling.ignore_eos, sampling.min_tokens, sampling.include_stop_str_in_output) == (True, 2, True)
    assert sampling.HasField("skip_special_tokens") and not sampling.skip_special_tokens
    assert sampling.HasField("spaces_between_special_tokens") and not sampling.spaces_between_special_tokens
    assert (sampling.logprobs, sampling.top_logprobs, sampling.prompt_logprobs, sampling.max_tokens) == (True, 3, 2, 3)
    assert sampling.default_temperature == 1.0


def test_token_controls_reach_the_protobuf_and_bad_ones_are_refused_by_name(harness):
    controls = {"logit_bias": {"7": -100, "42": 2.5}, "allowed_token_ids": [7, 8, 9], "bad_words": ["cat", "big dog"]}
    for route, base in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "x"})):
        assert harness.post(route, {**base, **controls})[0] == 200
        sampling = harness.gateway.last("Generate").sampling
        assert dict(sampling.logit_bias) == {7: -100.0, 42: 2.5}
        assert (list(sampling.allowed_token_ids), list(sampling.bad_words)) == ([7, 8, 9], ["cat", "big dog"])
        assert harness.post(route, {**base, "bad_words": []})[0] == 200  # no words: nothing banned
        received = len(harness.gateway.received["Generate"])
        for bad, param in [({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"1.5": 1}}, "logit_bias"),
                           ({"logit_bias": {"-3": 1}}, "logit_bias"), ({"logit_bias": {str(2**31): 1}}, "logit_bias"),
                           ({"logit_bias": {"7": "high"}}, "logit_bias.7"), ({"allowed_token_ids": []},
                                                                           "allowed_token_ids"),
                           ({"allowed_token_ids": [2**31]}, "allowed_token_ids.0"), ({"bad_words": [3]}, "bad_words.0")]:
            status, answer = harness.post(route, {**base, **bad})
            assert status == 400 and error_of(answer)["param"] == param, (bad, answer)
        assert len(harness.gateway.received["Generate"]) == received  # refused before the core


def test_absent_sampling_fields_stay_unset_so_the_models_defaults_apply(harness):
    assert harness.post("/v1/completions", {"prompt": "x"})[0] == 200
    sampling = harness.gateway.last("Generate").sampling
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "skip_special_tokens",
                 "spaces_between_special_tokens", "prompt_logprobs"):
        assert not sampling.HasField(name), name
    assert sampling.HasField("default_temperature") and sampling.default_temperature == 1.0
    assert sampling.max_tokens == chat_protocol.DEFAULT_COMPLETION_MAX_TOKENS


def test_chat_template_fields_reach_generate_and_tokenize(harness):
    messages = [{"role": "user", "content": "hi", "name": "ada"}, {"role": "assistant", "content": "Hello"}]
    kwargs = {"enable_thinking": False}
    documents = [{"title": "t", "text": "x"}]
    body = {"messages": messages, "continue_final_message": True, "chat_template_kwargs": kwargs, "documents": documents}
    assert harness.post("/v1/chat/completions", body)[0] == 200
    request = harness.gateway.last("Generate")
    assert request.continue_final_message and request.HasField("add_generation_prompt")
    assert not request.add_generation_prompt  # continue_final_message: the header is not added
    assert json.loads(request.chat_template_kwargs) == {**kwargs, "documents": documents}
    assert [m.name for m in request.messages] == ["ada", ""]  # a participant's name reaches the template
    body = {"model": ALIASES[1], "messages": messages, "continue_final_message": True, "chat_template_kwargs": kwargs}
    assert harness.post("/tokenize", body)[0] == 200
    tokenize = harness.gateway.last("Tokenize")
    assert (tokenize.model, tokenize.continue_final_message, tokenize.add_generation_prompt) == (BASE, True, False)
    assert json.loads(tokenize.chat_template_kwargs) == kwargs
    assert harness.post("/tokenize", {"messages": messages})[0] == 200
    plain = harness.gateway.last("Tokenize")
    assert not plain.HasField("add_generation_prompt") and not plain.chat_template_kwargs  # the decoder's defaults
    # add_generation_prompt false alone (no continue_final_message to imply it) reaches Generate and Tokenize
    for route, rpc in (("/v1/chat/completions", "Generate"), ("/tokenize", "Tokenize")):
        assert harness.post(route, {"messages": messages[:1], "add_generation_prompt": False})[0] == 200
        closed = harness.gateway.last(rpc)
        assert closed.HasField("add_generation_prompt") and not closed.add_generation_prompt, route
        assert not closed.continue_final_message, route
    assert harness.post("/v1/chat/completions", {"messages": messages[:1]})[0] == 200
    assert not harness.gateway.last("Generate").HasField("add_generation_prompt")  # the decoder's default: true


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
    ("/v1/chat/completions", {"documents": [{"text": "a"}], "chat_template_kwargs": {"documents": []}}, "documents"),
    ("/v1/chat/completions", {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/tokenize", {"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/rerank", {"raw_scores": True, "activation": True}, "activation")])
def test_fields_that_contradict_each_other_are_refused_naming_one(harness, route, body, param):
    base = ({"prompt": "x"} if route == "/v1/completions" else {"query": "q", "documents": ["d"]}
            if route == "/v1/rerank" else {"messages": [{"role": "user", "content": "hi"}]})
    status, answer = harness.post(route, {**base, **body})
    assert status == 400 and error_of(answer)["param"] == param, answer
    assert "Generate" not in harness.gateway.received


def test_aliases_name_the_base_and_pooling_models_and_answers_use_the_first_name(harness):
    status, answer = harness.post("/v1/chat/completions", {"model": ALIASES[1],
                                                           "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and answer["model"] == BASE and harness.gateway.last("Generate").lora == ""
    status, answer = harness.post("/v1/completions", {"model": "an-adapter", "prompt": "x"})
    assert status == 200 and harness.gateway.last("Generate").lora == "an-adapter"  # an adapter's name goes on
    for route, body, rpc in (("/v1/embeddings", {"input": "x"}, "Embed"), ("/embed", {"inputs": "x"}, "Embed"),
                             ("/v1/rerank", {"query": "q", "documents": ["d"]}, "Rerank"),
                             ("/v1/score", {"text_1": "q", "text_2": "d"}, "Rerank"),
                             ("/tokenize", {"prompt": "x"}, "Tokenize")):
        assert harness.post(route, {**body, "model": EMBEDDER_ALIAS})[0] == 200, route
        assert harness.gateway.last(rpc).model == EMBEDDER, route
    assert harness.post("/v1/embeddings", {"input": "x", "model": "unknown"})[0] == 200  # the pooler decides: here 200
    assert harness.gateway.last("Embed").model == "unknown"


def test_models_lists_the_first_served_name_with_its_generation_defaults(harness):
    status, listed = harness.post("/v1/models", None)
    assert status == 200
    ids = [m["id"] for m in listed["data"]]
    assert ids == [BASE, EMBEDDER, "qv"] and ALIASES[1] not in ids and EMBEDDER_ALIAS not in ids
    base = listed["data"][0]
    assert base["generation_config"] == "auto" and base["generation_defaults"] == pytest.approx(GENERATION_DEFAULTS)
    assert "generation_defaults" not in listed["data"][1]


def test_vllms_pooling_extras_reach_the_protobuf(harness):
    assert harness.post("/v1/embeddings", {"input": "x", "normalize": False})[0] == 200
    embed = harness.gateway.last("Embed")
    assert embed.HasField("normalize") and not embed.normalize
    for field in ("activation", "use_activation"):
        assert harness.post("/v1/rerank", {"query": "q", "documents": ["d"], field: False})[0] == 200
        assert harness.gateway.last("Rerank").raw_scores, field
        assert harness.post("/v1/score", {"text_1": "q", "text_2": "d", field: False})[0] == 200
        assert harness.gateway.last("Rerank").raw_scores, field
    assert harness.post("/v1/rerank", {"query": "q", "documents": ["d"], "activation": True})[0] == 200
    assert not harness.gateway.last("Rerank").raw_scores


def test_the_pooling_and_tokenize_bodies_fields_reach_the_protobuf(harness):
    """OpenAI's and TEI's fields on the embedding routes (dimensions, encoding_format, truncation;
    TEI's prompt_name and its normalize default, true), vLLM's top_n and return_documents on rerank,
    add_special_tokens on /tokenize: each reaches the pooling request, absent ones stay unset."""
    body = {"input": "x", "dimensions": 8, "encoding_format": "base64", "truncate": True, "truncation_direction": "left"}
    assert harness.post("/v1/embeddings", body)[0] == 200
    embed = harness.gateway.last("Embed")
    assert (embed.dimensions, embed.encoding_format, embed.truncate, embed.truncation_direction) == (
        8, pooling_pb2.ENCODING_FORMAT_BASE64, True, pooling_pb2.TRUNCATION_DIRECTION_LEFT)
    assert not embed.HasField("normalize") and not embed.prompt_name  # the model's own
    assert harness.post("/v1/embeddings", {"input": "x"})[0] == 200
    assert not harness.gateway.last("Embed").HasField("dimensions")
    assert harness.post("/embed", {"inputs": "x", "prompt_name": "query", "dimensions": 4})[0] == 200
    tei = harness.gateway.last("Embed")
    assert (tei.prompt_name, tei.dimensions) == ("query", 4)
    assert tei.HasField("normalize") and tei.normalize  # TEI's default
    assert harness.post("/embed", {"inputs": "x", "normalize": False})[0] == 200
    assert not harness.gateway.last("Embed").normalize
    assert harness.post("/v1/rerank", {"query": "q", "documents": ["a", "b"], "top_n": 1, "return_documents": True})[0] == 200
    rerank = harness.gateway.last("Rerank")
    assert rerank.HasField("top_n") and (rerank.top_n, rerank.return_documents) == (1, True)
    for value in (False, True):
        assert harness.post("/tokenize", {"prompt": "x", "add_special_tokens": value})[0] == 200
        tokenize = harness.gateway.last("Tokenize")
        assert tokenize.HasField("add_special_tokens") and tokenize.add_special_tokens is value
    assert harness.post("/tokenize", {"prompt": "x"})[0] == 200
    assert not harness.gateway.last("Tokenize").HasField("add_special_tokens")  # the tokenizer's default


def test_openapi_lists_the_honoured_and_accepted_fields_and_names_the_refused(app):
    status, document = call(app, "/openapi.json", None)
    assert status == 200
    schemas = document["components"]["schemas"]
    for model in _strict_models():
        schema = schemas[model.__name__]
        assert schema["additionalProperties"] is False
        assert set(schema["properties"]) == set(_declared(model)), model
        assert set(schema.get("x-refused", {})) == set(model.refused), model
        for name, info in _declared(model).items():
            assert (schema["properties"][name].get("x-tessera") == "accepted") == is_accepted(info), name
            options = schema["properties"][name].get("anyOf", [schema["properties"][name]])
            nullable = any(option.get("type") == "null" for option in options)
            assert nullable == (not info.is_required()), (model, name)  # null: the default
    assert "audio" in schemas["ChatCompletionRequest"]["x-refused"]
    assert "top_k" in schemas["CompletionRequest"]["properties"]


# A lone surrogate in each kind of string a body holds (as the raw JSON escape a client may send):
# refused naming its path before any call, never a 500 nor an event stream that carries it.
SURROGATES = [
    ("/v1/chat/completions", '{"model": "m", "max_tokens": 4, "request_id": "\\ud800", "messages": [%s]}', "request_id"),
    ("/v1/completions", '{"prompt": "x", "request_id": "\\ud800"}', "request_id"),
    ("/v1/completions", '{"prompt": "x", "stream": true, "request_id": "\\ud800"}', "request_id"),
    ("/v1/chat/completions", '{"messages": [%s], "stream": true, "request_id": "a\\udfffb"}', "request_id"),
    ("/v1/chat/completions", '{"messages": [%s], "user": "\\ud800"}', "user"),
    ("/v1/chat/completions", '{"model": "\\ud800", "messages": [%s]}', "model"),
    ("/v1/chat/completions", '{"messages": [%s], "metadata": {"\\udc00": "v"}}', "metadata.\\udc00"),
    ("/v1/chat/completions", '{"messages": [%s, {"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.1.content.0.text"),
    ("/v1/chat/completions", '{"messages": [%s], "stop": ["ok", "\\ud800"]}', "stop.1"),
    ("/v1/embeddings", '{"model": "\\ud800", "input": "x"}', "model"),
    ("/v1/embeddings", '{"input": ["x", "\\udfff"]}', "input.1"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/rerank", '{"query": "q", "documents": [{"text": "\\ud800"}]}', "documents.0.text"),
]


@pytest.mark.parametrize("route, body, param", SURROGATES)
def test_text_that_is_not_unicode_is_400_naming_its_field_before_any_call(harness, route, body, param):
    body = body.replace("%s", '{"role": "user", "content": "hi"}').encode()
    status, answer = harness.post(route, body)
    assert status == 400, answer
    assert error_of(answer)["param"] == param
    assert error_of(answer)["message"].startswith(f"{param} holds text that is not valid Unicode"), answer
    assert not harness.gateway.received, "refused before the core was called"


def test_teis_routes_refuse_text_that_is_not_unicode_in_teis_shape(harness):
    status, answer = harness.post("/embed", b'{"inputs": ["a", "\\ud800"]}')
    assert status == 400 and tei_error_of(answer)["error"].startswith("inputs.1 holds text that is not valid Unicode")


def test_a_surrogate_pair_is_text(harness):
    status, answer = harness.post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": '
                                                          b'"\\ud83d\\ude00"}], "request_id": "\\ud83d\\ude00"}')
    assert status == 200 and answer["id"] == "chatcmpl-\U0001f600"


def _optional_fields(model) -> list[str]:
    return [name for name, info in _declared(model).items() if not info.is_required()]


# optional fields that are the template's one input (one of two): null leaves the body without any
_THE_INPUT = {("/tokenize", "messages"), ("/v1/rerank", "documents")}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_null_is_the_default_of_every_optional_field(app, route):
    """The openai SDK sends null for a parameter passed as None (OpenAI's spec marks them nullable;
    vLLM declares them Optional[...] = default): null never refuses an honoured field."""
    template, objects = ROUTES[route]
    for path, model in objects.items():
        for name in _optional_fields(model):
            if (route, name) in _THE_INPUT:
                continue
            body = _copy(template)
            _at(body, path)[name] = None
            status, answer = call(app, route, json.dumps(body).encode())
            dotted = ".".join(str(p) for p in (*path, name))
            if status == 400 and route not in TEI_ROUTES:  # the default contradicts a sibling (stream_options)
                assert error_of(answer)["param"] not in (dotted, None), (route, dotted, answer)
            else:
                assert status == 503, (route, dotted, answer)  # past validation, on to the (unreachable) gateway


def test_null_sampling_fields_reach_the_protobuf_as_their_defaults(harness):
    nulls = {name: None for name in ("n", "presence_penalty", "frequency_penalty", "logprobs", "stream", "ignore_eos",
                                     "continue_final_message", "echo", "min_tokens", "include_stop_str_in_output")}
    status, answer = harness.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **nulls})
    assert status == 200 and answer["object"] == "chat.completion", answer  # not streamed: stream null is false
    request = harness.gateway.last("Generate")
    sampling = request.sampling
    assert (sampling.n, sampling.presence_penalty, sampling.frequency_penalty, sampling.logprobs, sampling.ignore_eos,
            sampling.min_tokens, request.continue_final_message) == (1, 0.0, 0.0, False, False, 0, False)
    nulls = {"echo": None, "logprobs": None, "stream": None, "n": None}
    status, answer = harness.post("/v1/completions", {"prompt": "x", **nulls})
    assert status == 200 and answer["choices"][0]["text"] == GENERATED_TEXT and answer["choices"][0]["logprobs"] is None
    assert harness.post("/v1/embeddings", {"input": "x", "encoding_format": None})[0] == 200
    assert harness.gateway.last("Embed").encoding_format == pooling_pb2.ENCODING_FORMAT_FLOAT


def test_null_is_still_refused_for_a_required_field(harness):
    status, answer = harness.post("/v1/chat/completions", {"messages": None})
    assert status == 400 and error_of(answer)["param"] == "messages"


HI = [{"role": "user", "content": "hi"}]
# (route, body, the core's refusal: message and protobuf field, the body's param, the answer's message)
NAMED_REFUSALS = [
    ("/v1/chat/completions", {"messages": HI, "n": 1000}, ("sampling.n is 1000; the limit is 16 (--max-n)", "sampling.n"),
     "n", "n is 1000; the limit is 16 (--max-n)"),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 4096},
     ("sampling.max_tokens is 4096; the model's context is 2048 tokens", "sampling.max_tokens"),
     "max_completion_tokens", "max_completion_tokens is 4096; the model's context is 2048 tokens"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 4096},
     ("sampling.max_tokens is 4096; the model's context", "sampling.max_tokens"), "max_tokens", "max_tokens is 4096"),
    ("/v1/chat/completions", {"messages": HI, "stop": ["a", "bb"]},
     ("sampling.stop[1] has 2 characters; the limit is 1 (--max-stop-chars)", "sampling.stop[1]"), "stop.1",
     "stop.1 has 2 characters"),
    ("/v1/chat/completions", {"messages": HI, "stop_token_ids": [-1]},
     ("sampling.stop_token_ids holds -1, outside the vocabulary [0, 49152)", "sampling.stop_token_ids"),
     "stop_token_ids", "stop_token_ids holds -1, outside the vocabulary"),
    ("/v1/chat/completions", {"messages": HI, "min_tokens": 9, "max_tokens": 4},
     ("min_tokens must be <= max_tokens (4), got 9", "sampling.min_tokens"), "min_tokens", "min_tokens must be <="),
    ("/v1/chat/completions", {"messages": HI, "repetition_penalty": 100},
     ("repetition_penalty must be in (0, 10], got 100.0", "sampling.repetition_penalty"), "repetition_penalty",
     "repetition_penalty must be in (0, 10]"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"tokenize": True}},
     ("chat_template_kwargs key 'tokenize' is refused: it is an argument of apply_chat_template",
      "chat_template_kwargs"), "chat_template_kwargs", "chat_template_kwargs key 'tokenize' is refused"),
    ("/v1/chat/completions", {"messages": HI}, ("messages[0].role has 300 characters", "messages[0].role"),
     "messages.0.role", "messages.0.role has 300 characters"),
    ("/v1/completions", {"prompt": "x", "logprobs": 20},
     ("sampling.top_logprobs is 20; the limit is 5 (--max-logprobs)", "sampling.top_logprobs"), "logprobs",
     "logprobs is 20; the limit is 5"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 20},
     ("sampling.prompt_logprobs is 20; the limit is 5", "sampling.prompt_logprobs"), "logprobs", "logprobs is 20"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 20},
     ("sampling.prompt_logprobs is 20; the limit is 5", "sampling.prompt_logprobs"), "prompt_logprobs",
     "prompt_logprobs is 20"),
    ("/v1/completions", {"prompt": [1, 2]}, ("prompt_token_ids has 2 ids and max_tokens 16; the model's context is 8",
                                             "prompt_token_ids"), "prompt", "prompt has 2 ids and max_tokens 16"),
    ("/detokenize", {"tokens": [-1]}, ("token_ids[0] is -1, outside the vocabulary [0, 49152)", "token_ids[0]"),
     "tokens.0", "tokens.0 is -1, outside the vocabulary"),
    ("/v1/embeddings", {"input": ""}, ("inputs[0] is an empty string; every input must hold text", "inputs[0]"),
     "input", "input is an empty string"),
    ("/v1/embeddings", {"input": ["a", ""]}, ("inputs[1] is an empty string", "inputs[1]"), "input.1",
     "input.1 is an empty string"),
    ("/v1/embeddings", {"input": [[1], []]}, ("input_ids[1] is an empty id list", "input_ids[1]"), "input.1",
     "input.1 is an empty id list"),
    ("/tokenize", {"prompt": "x"}, ("inputs[0] is an empty string", "inputs[0]"), "prompt", "prompt is an empty"),
    ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, ("documents[1] is an empty string", "documents[1]"),
     "documents.1", "documents.1 is an empty string"),
    ("/v1/score", {"text_1": "q", "text_2": ["a", ""]}, ("documents[1] is an empty string", "documents[1]"),
     "text_2.1", "text_2.1 is an empty string"),
]


@pytest.mark.parametrize("route, body, refusal, param, message", NAMED_REFUSALS)
def test_a_refusal_naming_a_protobuf_field_names_the_bodys_field(harness, route, body, refusal, param, message):
    harness.gateway.refusal = InvalidArgument(refusal[0], field=refusal[1])
    status, answer = harness.post(route, body)
    assert status == 400 and error_of(answer)["param"] == param, answer
    assert error_of(answer)["message"].startswith(message), answer


def test_teis_routes_name_teis_field(harness):
    harness.gateway.refusal = InvalidArgument("inputs[1] is an empty string", field="inputs[1]")
    status, answer = harness.post("/embed", {"inputs": ["a", ""]})
    assert status == 400 and tei_error_of(answer)["error"].startswith("inputs.1 is an empty string")
    harness.gateway.refusal = InvalidArgument("documents[0] is an empty string", field="documents[0]")
    status, answer = harness.post("/rerank", {"query": "q", "texts": [""]})
    assert status == 400 and tei_error_of(answer)["error"].startswith("texts.0 is an empty string")


def test_a_refusal_naming_no_field_keeps_param_null(harness):
    harness.gateway.refusal = InvalidArgument("prompt and messages has 9 images; the limit is 8 (--max-images)")
    status, answer = harness.post("/v1/chat/completions", {"messages": HI})
    assert status == 400 and error_of(answer)["param"] is None
    assert error_of(answer)["message"].startswith("prompt and messages has 9 images")


def test_an_empty_token_id_prompt_is_refused_naming_it(harness):
    for prompt, param in (([[]], "prompt.0"), ([[1], []], "prompt.1")):
        status, answer = harness.post("/v1/completions", {"prompt": prompt})
        assert status == 400 and error_of(answer)["param"] == param, answer
    assert "Generate" not in harness.gateway.received


def test_detokenize_without_a_model_asks_for_the_decoders(harness):
    """vLLM's /detokenize (and /tokenize) default to the served model: no model is the core's ""."""
    status, answer = harness.post("/detokenize", {"tokens": [1, 2]})
    assert status == 200 and harness.gateway.last("Detokenize").model == ""


def test_a_negative_seed_is_honoured_and_a_negative_min_tokens_refused_by_name(harness):
    """vLLM takes any int64 seed (torch's generator reads it modulo 2**64); min_tokens is >= 0."""
    assert harness.post("/v1/chat/completions", {"messages": HI, "seed": -1})[0] == 200
    assert harness.gateway.last("Generate").sampling.seed == -1
    for route, body in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "x"})):
        status, answer = harness.post(route, {**body, "min_tokens": -1})
        assert status == 400 and error_of(answer)["param"] == "min_tokens", answer
