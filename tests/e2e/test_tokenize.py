"""Tokenize and Detokenize through the cluster, by gRPC and HTTP: a decoder model (its name, a
loaded adapter's, or no model: the served model, as vLLM's /tokenize) is tokenized by the decoder's
tokenizer — ids equal transformers' AutoTokenizer, chat equal to `apply_chat_template` — and
detokenize(tokenize(text)) == text; a pooling model named gets its own tokenizer; refusals (too
many ids, an id out of vocabulary, an unknown model, a pooling model asked to detokenize or given
messages) get the same status over both doors."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import requests

import tessera.client as tc
from tessera.v1 import decoder_pb2, gateway_pb2, pooling_pb2

from .conftest import DECODER_MAX_MODEL_LEN, run_cli
from .test_lora import peft_adapter  # noqa: F401 - session fixture, reused

TEXTS = ["Hello tessera", "Naïve café: 日本語 and emoji 🙂, then code def f(x): return x."]
MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def decoder_model(gateway) -> str:
    return gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=60).decoder.model


@pytest.fixture(scope="module")
def embedding_model(gateway) -> str:
    return gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=60).pooling.model


def _messages_pb() -> list[decoder_pb2.ChatMessage]:
    return [decoder_pb2.ChatMessage(role=m["role"], content=[decoder_pb2.ContentPart(text=m["content"])])
            for m in MESSAGES]


def _post(http_url: str, path: str, body: dict) -> tuple[int, dict]:
    reply = requests.post(f"{http_url}{path}", json=body, timeout=60)
    return reply.status_code, reply.json()


def _refused(call, code: grpc.StatusCode, *words: str) -> str:
    with pytest.raises(grpc.RpcError) as error:
        call()
    assert error.value.code() == code, error.value.details()
    for word in words:
        assert word in error.value.details()
    return error.value.details()


def test_decoder_tokenize_and_detokenize_equal_tokenizer(gateway, http_url, hf_decoder, decoder_model,
                                                         embedding_model):
    _, tokenizer = hf_decoder
    for text in TEXTS:
        reply = gateway.Tokenize(pooling_pb2.TokenizeRequest(model=decoder_model, inputs=[text]), timeout=60)
        ids = [t.id for t in reply.results[0].tokens]
        assert ids == tokenizer(text)["input_ids"] and reply.max_model_len == DECODER_MAX_MODEL_LEN
        assert [t.text for t in reply.results[0].tokens] == tokenizer.convert_ids_to_tokens(ids)
        status, body = _post(http_url, "/tokenize", {"model": decoder_model, "prompt": text})
        assert status == 200 and body["tokens"] == ids and body["count"] == len(ids)
        assert body["max_model_len"] == DECODER_MAX_MODEL_LEN and body["token_strs"] == [t.text for t in reply.results[0].tokens]

        back = gateway.Detokenize(decoder_pb2.DetokenizeRequest(model=decoder_model, token_ids=ids), timeout=60)
        assert back.text == text == tokenizer.decode(ids) and back.model == decoder_model
        status, body = _post(http_url, "/detokenize", {"model": decoder_model, "tokens": ids})
        assert status == 200 and body["prompt"] == text
        status, body = _post(http_url, "/detokenize", {"tokens": ids})  # no model: the decoder's, as vLLM
        assert status == 200 and (body["model"], body["prompt"]) == (decoder_model, text)

    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    chat = gateway.Tokenize(pooling_pb2.TokenizeRequest(model=decoder_model, messages=_messages_pb()), timeout=60)
    assert [t.id for t in chat.results[0].tokens] == expected
    status, body = _post(http_url, "/tokenize", {"model": decoder_model, "messages": MESSAGES})
    assert status == 200 and body["tokens"] == expected
    status, body = _post(http_url, "/detokenize", {"model": decoder_model, "tokens": expected})
    assert body["prompt"] == tokenizer.decode(expected)

    # no model: the served model's (the decoder's) tokenizer, as vLLM's /tokenize, text and messages
    default = gateway.Tokenize(pooling_pb2.TokenizeRequest(inputs=[TEXTS[0]]), timeout=60)
    assert [t.id for t in default.results[0].tokens] == tokenizer(TEXTS[0])["input_ids"]
    assert default.model == decoder_model and default.max_model_len == DECODER_MAX_MODEL_LEN
    default_chat = gateway.Tokenize(pooling_pb2.TokenizeRequest(messages=_messages_pb()), timeout=60)
    assert [t.id for t in default_chat.results[0].tokens] == expected
    status, body = _post(http_url, "/tokenize", {"prompt": TEXTS[0]})
    assert status == 200 and body["tokens"] == tokenizer(TEXTS[0])["input_ids"]
    # the embedding model named: its own tokenizer (a different vocabulary, character offsets)
    pooled = gateway.Tokenize(pooling_pb2.TokenizeRequest(model=embedding_model, inputs=[TEXTS[0]]), timeout=60)
    assert [t.id for t in pooled.results[0].tokens] != tokenizer(TEXTS[0])["input_ids"] and pooled.max_model_len == 0
    assert pooled.model == embedding_model and pooled.results[0].tokens[1].stop > 0


def test_adapter_name_uses_the_decoder_tokenizer(gateway, gateway_address, http_url, hf_decoder, peft_adapter):  # noqa: F811
    _, tokenizer = hf_decoder
    result = run_cli(gateway_address, "adapters", "load", "tok-qv", "qv-adapter")
    assert result.returncode == 0, result.stderr
    try:
        status, body = _post(http_url, "/tokenize", {"model": "tok-qv", "prompt": TEXTS[1]})
        assert status == 200 and body["tokens"] == tokenizer(TEXTS[1])["input_ids"] and body["model"] == "tok-qv"
        back = gateway.Detokenize(decoder_pb2.DetokenizeRequest(model="tok-qv", token_ids=body["tokens"]), timeout=60)
        assert back.text == TEXTS[1]
    finally:
        run_cli(gateway_address, "adapters", "unload", "tok-qv")


def test_refusals_have_the_same_status_over_grpc_and_http(gateway, http_url, hf_decoder, decoder_model,
                                                          embedding_model, assert_healthy):
    _, tokenizer = hf_decoder
    vocab = len(tokenizer)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [  # (gRPC call, HTTP path and body, status, HTTP status, words in the message)
        (lambda: gateway.Detokenize(decoder_pb2.DetokenizeRequest(model=decoder_model, token_ids=[1] * 2049), timeout=60),
         ("/detokenize", {"model": decoder_model, "tokens": [1] * 2049}), invalid, 400, ("2049", "2048")),
        (lambda: gateway.Detokenize(decoder_pb2.DetokenizeRequest(model=decoder_model, token_ids=[5, vocab]), timeout=60),
         ("/detokenize", {"model": decoder_model, "tokens": [5, vocab]}), invalid, 400, ("token_ids[1]", str(vocab))),
        (lambda: gateway.Detokenize(decoder_pb2.DetokenizeRequest(model=embedding_model, token_ids=[5]), timeout=60),
         ("/detokenize", {"model": embedding_model, "tokens": [5]}), invalid, 400,
         (embedding_model, "pooling model", decoder_model)),
        (lambda: gateway.Detokenize(decoder_pb2.DetokenizeRequest(model="no-such-model", token_ids=[5]), timeout=60),
         ("/detokenize", {"model": "no-such-model", "tokens": [5]}), grpc.StatusCode.NOT_FOUND, 404,
         ("no-such-model", decoder_model)),
        (lambda: gateway.Tokenize(pooling_pb2.TokenizeRequest(model="no-such-model", inputs=["a"]), timeout=60),
         ("/tokenize", {"model": "no-such-model", "prompt": "a"}), grpc.StatusCode.NOT_FOUND, 404,
         ("no-such-model", decoder_model)),
        (lambda: gateway.Tokenize(pooling_pb2.TokenizeRequest(model=embedding_model, messages=_messages_pb()),
                                  timeout=60),
         ("/tokenize", {"model": embedding_model, "messages": MESSAGES}), invalid, 400, ("messages", decoder_model)),
    ]
    for call, (path, body), code, http_status, words in cases:
        details = _refused(call, code, *words)
        status, reply = _post(http_url, path, body)
        # the same refusal; its first word, a field, is the one each API names (token_ids[1] / tokens.1)
        assert status == http_status and reply["error"]["message"].partition(" ")[2] == details.partition(" ")[2], (
            path, body, reply)
    assert_healthy()


def test_client_and_cli_tokenize_with_model(gateway_address, hf_decoder, decoder_model):
    _, tokenizer = hf_decoder
    expected = tokenizer(TEXTS[1])["input_ids"]
    with tc.Client(gateway_address, timeout=60) as client:
        result = client.tokenize(TEXTS[1], model=decoder_model)
        assert [t.id for t in result.tokens[0]] == expected and result.max_model_len == DECODER_MAX_MODEL_LEN
        chat = client.tokenize(messages=MESSAGES, model=decoder_model)
        assert [t.id for t in chat.tokens[0]] == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)[
            "input_ids"]
        assert client.detokenize(expected, model=decoder_model) == TEXTS[1]
        with pytest.raises(tc.InvalidArgument):
            client.detokenize([len(tokenizer)], model=decoder_model)

    async def run_async():
        async with tc.AsyncClient(gateway_address, timeout=60) as aclient:
            result = await aclient.tokenize(TEXTS[1], model=decoder_model)
            return [t.id for t in result.tokens[0]], await aclient.detokenize(expected, model=decoder_model)

    assert asyncio.run(run_async()) == (expected, TEXTS[1])

    result = run_cli(gateway_address, "tokenize", *TEXTS, "--model", decoder_model, "--json")
    assert result.returncode == 0, result.stderr
    tokens = json.loads(result.stdout)["tokens"]
    assert [[t["id"] for t in row] for row in tokens] == [tokenizer(text)["input_ids"] for text in TEXTS]
