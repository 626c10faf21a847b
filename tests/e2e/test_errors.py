"""Bad input: the right status, a message that says what was wrong, and a healthy cluster after."""

from __future__ import annotations

import grpc
import pytest

from tessera.v1 import decoder_pb2, pooling_pb2

from .conftest import DECODER_MAX_MODEL_LEN
from .test_generate import collect


def raw_request(text: str, max_tokens: int) -> decoder_pb2.GenerateRequest:
    return decoder_pb2.GenerateRequest(prompt=[decoder_pb2.ContentPart(text=text)],
                                       sampling=decoder_pb2.SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("request_, needle", [
    (raw_request("", 8), "empty"),
    (decoder_pb2.GenerateRequest(sampling=decoder_pb2.SamplingParams(max_tokens=8)), "prompt"),
    (raw_request("Hello", -1), "max_tokens"),
    (raw_request("Hello", DECODER_MAX_MODEL_LEN + 10), str(DECODER_MAX_MODEL_LEN)),
    (decoder_pb2.GenerateRequest(messages=[decoder_pb2.ChatMessage(role="wizard", content=[
        decoder_pb2.ContentPart(text="hi")])], sampling=decoder_pb2.SamplingParams(max_tokens=4)), "role"),
], ids=["empty-text", "no-prompt", "max-tokens-negative", "past-context", "bad-role"])
def test_bad_generate_requests(gateway, assert_healthy, request_, needle):
    with pytest.raises(grpc.RpcError) as error:
        collect(gateway, request_)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in error.value.details()
    assert_healthy()
    assert collect(gateway, raw_request("Hello", 2))["finish"]


@pytest.mark.parametrize("request_, needle", [
    (pooling_pb2.EmbedRequest(inputs=[]), "empty"),
    (pooling_pb2.EmbedRequest(inputs=["fine", ""]), "empty"),
    (pooling_pb2.EmbedRequest(inputs=["word " * 2000]), "tokens"),
], ids=["empty-batch", "empty-string", "too-long"])
def test_bad_embed_requests(gateway, assert_healthy, request_, needle):
    with pytest.raises(grpc.RpcError) as error:
        gateway.Embed(request_, timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in error.value.details()
    assert_healthy()


@pytest.mark.parametrize("request_", [
    pooling_pb2.RerankRequest(query="q", documents=[]),
    pooling_pb2.RerankRequest(query="q", documents=["a", "b"], top_n=0),
    pooling_pb2.RerankRequest(query="", documents=["a"]),
], ids=["no-documents", "top-n-0", "empty-query"])
def test_bad_rerank_requests(gateway, assert_healthy, request_):
    with pytest.raises(grpc.RpcError) as error:
        gateway.Rerank(request_, timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_healthy()


def test_unknown_embedding_model_is_not_found(gateway):
    with pytest.raises(grpc.RpcError) as error:
        gateway.Embed(pooling_pb2.EmbedRequest(model="no-such-model", inputs=["x"]), timeout=60)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
