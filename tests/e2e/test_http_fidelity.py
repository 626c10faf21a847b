"""Every field the HTTP API honours changes the answer as it should, against the real cluster and
transformers' reference on the same checkpoint: vLLM's sampling extras, echo with prompt logprobs
(lm-evaluation-harness's loglikelihood request), chat template fields through /tokenize."""

from __future__ import annotations

import json

import openai
import pytest
import requests
import torch

from .test_http_openai import info, sdk  # noqa: F401 - the session's SDK client and cluster info

ANIMALS = "The list of animals: cat, dog, cat, dog, cat, dog,"


def _ids(choice) -> list[int]:
    """The token ids of a completion choice asked with logprobs and return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def test_top_k_1_is_greedy_at_any_temperature(sdk, info):  # noqa: F811
    common = dict(model=info.decoder.model, prompt=ANIMALS, max_tokens=8)
    greedy = sdk.completions.create(**common, temperature=0).choices[0].text
    top_1 = sdk.completions.create(**common, temperature=1.5, seed=3, extra_body={"top_k": 1}).choices[0].text
    sampled = sdk.completions.create(**common, temperature=1.5, seed=3).choices[0].text
    assert top_1 == greedy
    assert sampled != greedy, "at temperature 1.5 the sampled text must differ for top_k to mean anything"


def _reference_logprobs(hf_decoder, text: str) -> tuple[list[int], torch.Tensor]:
    """transformers' fp32 log_softmax of each next token of `text`: (ids, [len(ids), vocab])."""
    model, tokenizer = hf_decoder
    ids = tokenizer(text)["input_ids"]
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_the_prompt_tokens_logprobs_of_transformers(sdk, info, hf_decoder, max_tokens):  # noqa: F811
    """lm-evaluation-harness's local-completions loglikelihood request: echo, logprobs 1, max_tokens 0 or 1."""
    reply = sdk.completions.create(model=info.decoder.model, prompt=ANIMALS, echo=True, logprobs=1,
                                   max_tokens=max_tokens, temperature=0)
    ids, reference = _reference_logprobs(hf_decoder, ANIMALS)
    [choice] = reply.choices
    logprobs = choice.logprobs
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == max_tokens
    assert len(logprobs.tokens) == len(ids) + max_tokens
    assert "".join(logprobs.tokens[:len(ids)]) == ANIMALS and choice.text.startswith(ANIMALS)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
    for i in range(1, len(ids)):  # the chosen token, and the most likely one
        best = reference[i - 1].max().item()
        assert max(logprobs.top_logprobs[i].values()) == pytest.approx(best, abs=1e-4)
    assert logprobs.text_offset[:len(ids)] == [len("".join(logprobs.tokens[:i])) for i in range(len(ids))]
    if max_tokens == 0:
        assert choice.text == ANIMALS and choice.finish_reason == "length"


def test_repetition_penalty_equals_transformers(sdk, info, hf_decoder):  # noqa: F811
    model, tokenizer = hf_decoder
    common = dict(model=info.decoder.model, prompt=ANIMALS, max_tokens=8, temperature=0, logprobs=0,
                  extra_body={"return_tokens_as_token_ids": True})
    plain = _ids(sdk.completions.create(**common).choices[0])
    penalized = _ids(sdk.completions.create(**{**common, "extra_body": {
        "return_tokens_as_token_ids": True, "repetition_penalty": 2.0}}).choices[0])
    prompt = torch.tensor([tokenizer(ANIMALS)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, repetition_penalty=2.0)
    assert penalized == out[0, prompt.shape[1]:].tolist()[:len(penalized)] and len(penalized) == 8
    assert penalized != plain


def test_ignore_eos_runs_to_max_tokens(sdk, info):  # noqa: F811
    messages = [{"role": "user", "content": "What is 2+2?"}]
    stopped = sdk.chat.completions.create(model=info.decoder.model, messages=messages, max_tokens=40, temperature=0)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 40
    running = sdk.chat.completions.create(model=info.decoder.model, messages=messages, max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert running.choices[0].finish_reason == "length" and running.usage.completion_tokens == 40


def test_tokenize_takes_the_chat_template_fields_as_transformers(http_url, info, hf_decoder):  # noqa: F811
    _, tokenizer = hf_decoder
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    reply = requests.post(f"{http_url}/tokenize", timeout=60, json={
        "model": info.decoder.model, "messages": messages, "continue_final_message": True,
        "add_generation_prompt": False, "chat_template_kwargs": {"unused_variable": 1}}).json()
    expected = tokenizer.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False,
                                             tokenize=True, return_dict=True, unused_variable=1)["input_ids"]
    assert reply["tokens"] == list(expected)
    closed = requests.post(f"{http_url}/tokenize", json={"model": info.decoder.model, "messages": messages},
                           timeout=60).json()
    assert len(closed["tokens"]) > len(reply["tokens"])  # the message closed and the assistant's header added
    # the kwargs reach the template's renderer: one of apply_chat_template's own arguments is refused there
    refused = requests.post(f"{http_url}/tokenize", json={"model": info.decoder.model, "messages": messages,
                                                          "chat_template_kwargs": {"tokenize": False}}, timeout=60)
    assert refused.status_code == 400 and "tokenize" in refused.json()["error"]["message"]


def test_unknown_and_refused_fields_are_400_naming_them(sdk, info):  # noqa: F811
    messages = [{"role": "user", "content": "hi"}]
    for extra, param in (({"modalities": ["text", "audio"]}, "modalities"), ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
                         ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
                         ({"reasoning_effort": "low"}, "reasoning_effort"), ({"topk": 1}, "topk")):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model=info.decoder.model, messages=messages, max_tokens=2, extra_body=extra)
        assert refused.value.body["param"] == param
    reply = sdk.chat.completions.create(model=info.decoder.model, messages=messages, max_tokens=2, user="u",
                                        store=False, service_tier="auto", metadata={"k": "v"})
    assert reply.choices[0].message.content is not None


def test_refusals_of_the_services_behind_name_the_bodys_field(http_url, info):  # noqa: F811
    """A cap of the gateway, a check of the decoder or the pooling service: the answer's param and
    message name the HTTP body's field, not the protobuf's (the field travels as data)."""
    chat = {"model": info.decoder.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ("/v1/chat/completions", {**chat, "n": 1000}, "n"),
        ("/v1/chat/completions", {**chat, "max_tokens": 2**31 - 1}, "max_tokens"),
        ("/v1/chat/completions", {**chat, "stop": ["s"] * 100}, "stop"),
        ("/v1/chat/completions", {**chat, "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/chat/completions", {**chat, "min_tokens": 5}, "min_tokens"),
        ("/v1/chat/completions", {**chat, "repetition_penalty": 100}, "repetition_penalty"),
        ("/v1/chat/completions", {**chat, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": ["a", ""]}, "input.1"),
    ]
    for route, body, param in cases:
        reply = requests.post(f"{http_url}{route}", json=body, timeout=60)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == param, (route, body, error)
        assert error["message"].startswith(param), error


def test_a_negative_seed_is_a_seed_and_null_is_the_default(sdk, info):  # noqa: F811
    common = dict(model=info.decoder.model, prompt=ANIMALS, max_tokens=8, temperature=1.5)
    first, again = (sdk.completions.create(**common, seed=-1).choices[0].text for _ in range(2))
    assert first == again
    reply = sdk.completions.create(**common, seed=3, presence_penalty=None, frequency_penalty=None, n=None)
    assert reply.choices[0].text == sdk.completions.create(**common, seed=3).choices[0].text


def test_text_that_is_not_unicode_is_refused_before_any_work(http_url, info):  # noqa: F811
    body = json.dumps({"model": info.decoder.model, "max_tokens": 4, "request_id": "@",
                       "messages": [{"role": "user", "content": "hi"}]}).replace("@", "\\ud800")  # JSON's escape
    for stream in (False, True):
        raw = body[:-1] + f', "stream": {json.dumps(stream)}}}'
        reply = requests.post(f"{http_url}/v1/chat/completions", data=raw, headers={"content-type": "application/json"},
                              timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "request_id", reply.text
