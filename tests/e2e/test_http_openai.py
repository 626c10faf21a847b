"""The gateway's HTTP API through the official `openai` SDK, unchanged, equal to the gRPC answers."""

from __future__ import annotations

import base64
import socket

import numpy as np
import openai
import pytest
import requests

from tessera.v1 import adapters_pb2, decoder_pb2, gateway_pb2, pooling_pb2

from .conftest import DECODER_MAX_MODEL_LEN
from .test_generate import CHAT_PROMPTS, chat_request, collect
from .test_images import png_bytes
from .test_lora import peft_adapter  # noqa: F401 - the session's PEFT adapter fixture


@pytest.fixture(scope="session")
def sdk(http_url) -> openai.OpenAI:
    # max_retries=0: a refusal must reach the test as the status the gateway answered
    with openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="session")
def info(gateway) -> gateway_pb2.ClusterInfo:
    return gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30)


def test_greedy_chat_equals_grpc_generate(sdk, gateway, info):
    for prompt in CHAT_PROMPTS[:1]:
        expected = collect(gateway, chat_request(prompt, 10))
        reply = sdk.chat.completions.create(model=info.decoder.model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=10, temperature=0)
        [choice] = reply.choices
        assert choice.message.content == "".join(expected["text"])
        assert choice.finish_reason == expected["finish"]
        assert reply.usage.prompt_tokens == expected["usage"].prompt_tokens
        assert reply.usage.completion_tokens == len(expected["ids"])


def test_chat_stream_equals_whole_answer_and_counts_usage(sdk, info):
    kwargs = dict(model=info.decoder.model, messages=[{"role": "user", "content": CHAT_PROMPTS[2]}],
                  max_completion_tokens=8, temperature=0)
    whole = sdk.chat.completions.create(**kwargs)
    chunks = list(sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len(chunks) > 3, "tokens stream one event at a time"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_sampling_fields_reach_the_decoder(sdk, info):
    kwargs = dict(model=info.decoder.model, messages=[{"role": "user", "content": CHAT_PROMPTS[1]}],
                  max_tokens=4, temperature=0.9, top_p=0.95, seed=1234, n=2, logprobs=True, top_logprobs=3,
                  presence_penalty=0.5, frequency_penalty=0.5)
    first, second = sdk.chat.completions.create(**kwargs), sdk.chat.completions.create(**kwargs)
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert [c.index for c in first.choices] == [0, 1] and first.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in first.choices)
    for entry in first.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
    stopped = sdk.chat.completions.create(model=info.decoder.model, max_tokens=8, temperature=0, stop="Paris",
                                          messages=[{"role": "user", "content": CHAT_PROMPTS[0]}])
    assert stopped.choices[0].finish_reason == "stop" and "Paris" not in stopped.choices[0].message.content


def test_completions_text_and_token_ids_equal_grpc(sdk, gateway, info):
    raw = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text="The capital of France is")],
                                      sampling=decoder_pb2.SamplingParams(max_tokens=3))
    expected = collect(gateway, raw)
    text = sdk.completions.create(model=info.decoder.model, prompt="The capital of France is", max_tokens=3,
                                  temperature=0)
    assert text.choices[0].text == "".join(expected["text"]) and text.object == "text_completion"
    ids = collect(gateway, decoder_pb2.GenerateRequest(prompt_token_ids=[504, 3575, 282], sampling=raw.sampling))
    by_ids = sdk.completions.create(model=info.decoder.model, prompt=[504, 3575, 282], max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == "".join(ids["text"]) and by_ids.usage.prompt_tokens == 3
    batch = sdk.completions.create(model=info.decoder.model, prompt=["The capital of France is", "1, 2, 3,"],
                                   max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == text.choices[0].text
    echoed = sdk.completions.create(model=info.decoder.model, prompt="The capital of France is", max_tokens=3,
                                    temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + text.choices[0].text


def test_embeddings_float_and_base64_equal_grpc(sdk, gateway, info):
    texts = ["a cat sat on the mat", "tessera serves models"]
    reply = gateway.Embed(pooling_pb2.EmbedRequest(inputs=texts), timeout=60)
    expected = np.frombuffer(reply.embeddings.data, dtype="<f4").reshape(tuple(reply.embeddings.shape))
    as_float = sdk.embeddings.create(model=info.pooling.model, input=texts, encoding_format="float")
    assert np.array_equal(np.array([d.embedding for d in as_float.data], dtype=np.float32), expected)
    as_base64 = sdk.embeddings.create(model=info.pooling.model, input=texts)  # the SDK asks base64 and decodes it
    assert np.array_equal(np.array([d.embedding for d in as_base64.data], dtype=np.float32), expected)
    raw = requests.post(f"{sdk.base_url}embeddings", json={"model": info.pooling.model, "input": texts[0],
                                                        "encoding_format": "base64"}, timeout=60).json()
    # one text is a batch of one: compared with gRPC's answer for that text alone (a row's float32
    # bits may differ between batch shapes)
    alone = gateway.Embed(pooling_pb2.EmbedRequest(inputs=texts[:1]), timeout=60)
    assert np.array_equal(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4"),
                          np.frombuffer(alone.embeddings.data, dtype="<f4"))
    np.testing.assert_allclose(np.frombuffer(alone.embeddings.data, dtype="<f4"), expected[0], atol=1e-5)
    assert as_float.usage.prompt_tokens == reply.usage.prompt_tokens > 0


def test_models_list_names_every_served_model(sdk, info):
    ids = {m.id for m in sdk.models.list().data}
    assert {info.decoder.model, info.pooling.model} <= ids


def test_adapter_selected_by_model_equals_grpc(sdk, gateway, http_url, info, peft_adapter):  # noqa: F811
    loaded = requests.post(f"{http_url}/v1/load_lora_adapter", json={"lora_name": "http-qv", "lora_path": "qv-adapter"},
                        timeout=120)
    assert loaded.status_code == 200, loaded.text
    try:
        [listed] = [m for m in sdk.models.list().data if m.id == "http-qv"]
        assert listed.parent == info.decoder.model
        [raw] = [m for m in requests.get(f"{http_url}/v1/models", timeout=30).json()["data"] if m["id"] == "http-qv"]
        entry = loaded.json()
        assert abs(entry.pop("created") - raw.pop("created")) <= 60, "created is the answer's time (vLLM's)"
        assert entry == raw and raw["max_model_len"] == info.decoder.max_model_len, "the entry /v1/models lists"
        request = chat_request(CHAT_PROMPTS[1], 6, logprobs=True)
        request.lora = "http-qv"
        expected = list(gateway.Generate(request, timeout=300))
        expected_logprobs = [(e.token_id, e.logprob) for r in expected for e in r.logprobs]
        reply = sdk.chat.completions.create(model="http-qv", messages=[{"role": "user", "content": CHAT_PROMPTS[1]}],
                                            max_tokens=6, temperature=0, logprobs=True,
                                            extra_body={"return_tokens_as_token_ids": True})
        assert reply.choices[0].message.content == "".join(r.text for r in expected)
        answered = [(int(e.token.removeprefix("token_id:")), e.logprob) for e in reply.choices[0].logprobs.content]
        # the same tokens; log-probabilities to float32 noise (a prefix-cache hit sums in another order)
        assert [t for t, _ in answered] == [t for t, _ in expected_logprobs]
        assert np.allclose([lp for _, lp in answered], [lp for _, lp in expected_logprobs], rtol=0, atol=1e-4)
        base = list(gateway.Generate(chat_request(CHAT_PROMPTS[1], 6, logprobs=True), timeout=300))
        base_logprobs = [e.logprob for r in base for e in r.logprobs]
        assert np.abs(np.array(base_logprobs) - [lp for _, lp in expected_logprobs]).max() > 1e-2, \
            "the adapter must change the distribution for this test to mean anything"
    finally:
        unloaded = requests.post(f"{http_url}/v1/unload_lora_adapter", json={"lora_name": "http-qv"}, timeout=120)
    assert unloaded.status_code == 200, unloaded.text
    assert "http-qv" not in {a.name for a in gateway.ListAdapters(adapters_pb2.ListAdaptersRequest(), timeout=30).adapters}


def test_image_chat_through_a_data_uri(sdk, info):
    data_uri = "data:image/png;base64," + base64.b64encode(png_bytes(40, 30)).decode()
    text_only = sdk.chat.completions.create(model=info.decoder.model, max_tokens=1, temperature=0,
                                            messages=[{"role": "user", "content": "Describe the image."}])
    reply = sdk.chat.completions.create(model=info.decoder.model, max_tokens=1, temperature=0, messages=[{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri}},
                                    {"type": "text", "text": "Describe the image."}]}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > text_only.usage.prompt_tokens, "the image's tokens count as prompt tokens"


def _error(raised: pytest.ExceptionInfo) -> dict:
    body = raised.value.body
    assert set(body) >= {"message", "type", "param", "code"}, body  # the SDK unwraps {"error": {...}}
    return body


def test_refusals_answer_openai_errors_with_their_status(sdk, info, http_url, assert_healthy):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(openai.BadRequestError) as remote:
        sdk.chat.completions.create(model=info.decoder.model, messages=[{"role": "user", "content": [image]}])
    assert "data URI" in _error(remote)["message"] and remote.value.status_code == 400
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "no-such-model" in _error(unknown)["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=info.decoder.model, messages=[{"role": "user", "content": "hi"}],
                                    temperature=7)
    assert _error(bad)["param"] == "temperature"
    too_long = "hello " * (DECODER_MAX_MODEL_LEN + 100)  # one token per word: past the context
    with pytest.raises(openai.BadRequestError) as long_prompt:
        sdk.completions.create(model=info.decoder.model, prompt=too_long, max_tokens=4)
    assert str(DECODER_MAX_MODEL_LEN) in _error(long_prompt)["message"]
    with pytest.raises(openai.BadRequestError) as over_cap:  # past the gateway's character cap: never tokenized
        sdk.completions.create(model=info.decoder.model, prompt="x" * (40 * DECODER_MAX_MODEL_LEN), max_tokens=4)
    assert "--max-prompt-chars" in _error(over_cap)["message"]
    assert _oversized_body_status(http_url) == 413
    assert_healthy()


def _oversized_body_status(http_url: str) -> int:
    """A body announced at 1 TB is refused from its headers, before any of it is read."""
    host, port = http_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000000\r\n\r\n{")
        return int(conn.recv(4096).split(b" ", 2)[1])


def test_rerank_and_tokenize_equal_grpc(http_url, gateway):
    documents = ["a dog in the park", "a cat on a mat", "stock prices fell"]
    expected = gateway.Rerank(pooling_pb2.RerankRequest(query="cat", documents=documents, top_n=2,
                                                        return_documents=True), timeout=60)
    for path in ("/v1/rerank", "/rerank"):
        reply = requests.post(f"{http_url}{path}", json={"query": "cat", "documents": documents, "top_n": 2,
                                                      "return_documents": True}, timeout=60).json()
        assert [(r["index"], r["document"]["text"]) for r in reply["results"]] == [
            (r.index, r.document) for r in expected.results]
        assert np.allclose([r["relevance_score"] for r in reply["results"]], [r.score for r in expected.results],
                           rtol=0, atol=1e-7)
    # top_n past the document count: every document, sorted, over both doors (clamped as TEI and vLLM do)
    everything = gateway.Rerank(pooling_pb2.RerankRequest(query="cat", documents=documents, top_n=10), timeout=60)
    assert sorted(r.index for r in everything.results) == [0, 1, 2]
    assert [r.score for r in everything.results] == sorted((r.score for r in everything.results), reverse=True)
    reply = requests.post(f"{http_url}/v1/rerank", json={"query": "cat", "documents": documents, "top_n": 10},
                          timeout=60).json()
    assert [r["index"] for r in reply["results"]] == [r.index for r in everything.results]
    tokens = gateway.Tokenize(pooling_pb2.TokenizeRequest(inputs=["hello tessera"]), timeout=60).results[0].tokens
    reply = requests.post(f"{http_url}/tokenize", json={"prompt": "hello tessera"}, timeout=60).json()
    assert reply["tokens"] == [t.id for t in tokens] and reply["count"] == len(tokens)
    assert reply["token_strs"] == [t.text for t in tokens]


def test_embeddings_past_the_input_length_refused_or_cut_with_truncate(sdk, gateway, info):
    """The 400 for a too-long input says "set truncate to cut it": the HTTP body has TEI's `truncate`
    and `truncation_direction`, and they give gRPC's answer (an unknown field would be ignored)."""
    text = " ".join(f"word{i}" for i in range(400))
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.embeddings.create(model=info.pooling.model, input=text, encoding_format="float")
    assert "set truncate to cut it" in refused.value.body["message"]
    for direction, enum in (("right", pooling_pb2.TRUNCATION_DIRECTION_RIGHT),
                            ("Left", pooling_pb2.TRUNCATION_DIRECTION_LEFT)):
        reply = gateway.Embed(pooling_pb2.EmbedRequest(inputs=[text], truncate=True, truncation_direction=enum),
                              timeout=60)
        expected = np.frombuffer(reply.embeddings.data, dtype="<f4")
        cut = sdk.embeddings.create(model=info.pooling.model, input=text, encoding_format="float",
                                    extra_body={"truncate": True, "truncation_direction": direction})
        assert np.array_equal(np.array(cut.data[0].embedding, dtype=np.float32), expected)
        assert cut.usage.prompt_tokens == reply.usage.prompt_tokens
    assert not np.array_equal(*[np.frombuffer(gateway.Embed(pooling_pb2.EmbedRequest(
        inputs=[text], truncate=True, truncation_direction=enum), timeout=60).embeddings.data, dtype="<f4")
        for enum in (pooling_pb2.TRUNCATION_DIRECTION_RIGHT, pooling_pb2.TRUNCATION_DIRECTION_LEFT)])


def test_vllms_leniencies_model_optional_documents_by_default_truncate_prompt_tokens(http_url, gateway, info):
    """What vLLM accepts that OpenAI's API does not: no `model` (the served one), rerank results
    with their documents and an id by default, truncate_prompt_tokens -1 (cut to the maximum input
    length, keeping the last tokens)."""
    chat = requests.post(f"{http_url}/v1/chat/completions", timeout=120,
                         json={"messages": [{"role": "user", "content": CHAT_PROMPTS[0]}], "max_tokens": 4,
                               "temperature": 0}).json()
    assert chat["model"] == info.decoder.model and chat["choices"][0]["message"]["content"]
    expected = collect(gateway, chat_request(CHAT_PROMPTS[0], 4))
    assert chat["choices"][0]["message"]["content"] == "".join(expected["text"])
    embedded = requests.post(f"{http_url}/v1/embeddings", json={"input": "a cat"}, timeout=60).json()
    assert embedded["model"] == info.pooling.model and len(embedded["data"][0]["embedding"]) == 384
    reranked = requests.post(f"{http_url}/v1/rerank", json={"query": "cat", "documents": ["a cat", "stocks"]},
                             timeout=60).json()
    assert reranked["id"].startswith("rerank-") and {r["document"]["text"] for r in reranked["results"]} == {
        "a cat", "stocks"}
    long_text = "Paris is the capital of France. " * 80
    cut = gateway.Embed(pooling_pb2.EmbedRequest(inputs=[long_text], truncate=True,
                                                 truncation_direction=pooling_pb2.TRUNCATION_DIRECTION_LEFT), timeout=60)
    reply = requests.post(f"{http_url}/v1/embeddings", json={"input": long_text, "truncate_prompt_tokens": -1},
                          timeout=60).json()
    assert np.array_equal(np.array(reply["data"][0]["embedding"], dtype=np.float32),
                          np.frombuffer(cut.embeddings.data, "<f4"))
