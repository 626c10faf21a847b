"""text-embeddings-inference's native doors on the gateway (/embed, POST /, /rerank with `texts`,
/info), through TEI's own client (huggingface_hub's InferenceClient, unchanged) and plain HTTP, and
vLLM's /score, equal to sentence-transformers and to the gRPC answers."""

from __future__ import annotations

import numpy as np
import pytest
import requests
from huggingface_hub import InferenceClient
from huggingface_hub.errors import HfHubHTTPError
from sentence_transformers import SentenceTransformer

from tessera.v1 import gateway_pb2, pooling_pb2

TEXTS = ["The cat sat on the mat.", "Stock prices fell sharply today.", "A kitten sleeps on a rug."]
LONG_TEXT = "Paris is the capital and largest city of France. " * 60  # past all-MiniLM's 256 tokens


@pytest.fixture(scope="session")
def reference(embedding_dir) -> SentenceTransformer:
    return SentenceTransformer(str(embedding_dir), device="cpu")


@pytest.fixture
def hub_client_online(monkeypatch):
    """huggingface_hub refuses every request, a local server's too, while HF_HUB_OFFLINE is set (the
    adapter tests set it for the session; read once, at import): let InferenceClient reach the gateway."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture(scope="session")
def pooling_info(gateway) -> pooling_pb2.PoolingInfo:
    return gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30).pooling


def test_inference_client_feature_extraction_equals_sentence_transformers(http_url, reference, hub_client_online):
    client = InferenceClient(model=http_url, timeout=120)  # posts TEI's body to the root route, as to TEI
    expected = reference.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    vectors = client.feature_extraction(TEXTS)
    assert vectors.shape == expected.shape and np.allclose(vectors, expected, rtol=0, atol=1e-5)
    one = client.feature_extraction(TEXTS[0])
    assert one.shape == (1, expected.shape[1]) and np.allclose(one[0], expected[0], rtol=0, atol=1e-5)


def test_embed_fields_normalize_token_ids_and_truncate(http_url, gateway, pooling_info):
    def embed(**body):
        reply = requests.post(f"{http_url}/embed", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return np.array(reply.json(), dtype=np.float32)

    normalized = embed(inputs=TEXTS)
    raw = embed(inputs=TEXTS, normalize=False)
    assert np.allclose(np.linalg.norm(normalized, axis=1), 1, atol=1e-5)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1, atol=1e-2), "normalize false answers the pooled vectors"
    assert np.allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), normalized, rtol=0, atol=1e-5)
    ids = gateway.Tokenize(pooling_pb2.TokenizeRequest(model=pooling_info.model, inputs=TEXTS[:1]),
                           timeout=60).results[0].tokens
    assert np.allclose(embed(inputs=[t.id for t in ids]), normalized[:1], rtol=0, atol=1e-6)
    for direction in ("right", "Left"):
        expected = gateway.Embed(pooling_pb2.EmbedRequest(
            inputs=[LONG_TEXT], truncate=True, normalize=True,
            truncation_direction=pooling_pb2.TruncationDirection.Value(f"TRUNCATION_DIRECTION_{direction.upper()}")),
            timeout=120)
        cut = embed(inputs=LONG_TEXT, truncate=True, truncation_direction=direction)
        assert np.array_equal(cut, np.frombuffer(expected.embeddings.data, "<f4").reshape(1, -1))


def test_refusals_answer_teis_error_shape(http_url, hub_client_online):
    too_long = requests.post(f"{http_url}/embed", json={"inputs": LONG_TEXT}, timeout=60)
    assert too_long.status_code == 400
    assert too_long.json()["error_type"] == "validation" and "set truncate to cut it" in too_long.json()["error"]
    bad = requests.post(f"{http_url}/embed", json={"inputs": "x", "truncate": "yes"}, timeout=60)
    assert bad.status_code == 400 and set(bad.json()) == {"error", "error_type"} and "truncate" in bad.json()["error"]
    with pytest.raises(HfHubHTTPError, match="the maximum input length is 256"):  # TEI's client reads the message
        InferenceClient(model=http_url, timeout=60).feature_extraction(LONG_TEXT)
    # the OpenAI routes keep OpenAI's shape
    openai_shaped = requests.post(f"{http_url}/v1/embeddings", json={"model": "x", "input": "x", "truncate": "yes"},
                                  timeout=60)
    assert openai_shaped.status_code == 400 and set(openai_shaped.json()["error"]) >= {"message", "type", "param"}


def test_tei_rerank_equals_grpc(http_url, gateway):
    query, documents = "a cat", ["a dog in the park", "a cat on a mat", "stock prices fell"]
    expected = gateway.Rerank(pooling_pb2.RerankRequest(query=query, documents=documents), timeout=60)
    reply = requests.post(f"{http_url}/rerank", json={"query": query, "texts": documents, "return_text": True},
                          timeout=60)
    assert reply.status_code == 200, reply.text
    ranks = reply.json()
    assert [(r["index"], r["text"]) for r in ranks] == [(r.index, documents[r.index]) for r in expected.results]
    assert np.allclose([r["score"] for r in ranks], [r.score for r in expected.results], rtol=0, atol=1e-7)
    plain = requests.post(f"{http_url}/rerank", json={"query": query, "texts": documents}, timeout=60).json()
    assert all(set(r) == {"index", "score"} for r in plain), "text only when return_text"
    long_documents = [LONG_TEXT, "a cat on a mat"]
    refused = requests.post(f"{http_url}/rerank", json={"query": query, "texts": long_documents}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error_type"] == "validation"
    assert "document 0 has" in refused.json()["error"]
    cut = requests.post(f"{http_url}/rerank", json={"query": query, "texts": long_documents, "truncate": True},
                        timeout=60).json()
    expected = gateway.Rerank(pooling_pb2.RerankRequest(query=query, documents=long_documents, truncate=True), timeout=60)
    assert [(r["index"], r["score"]) for r in cut] == [(r.index, r.score) for r in expected.results]
    both = requests.post(f"{http_url}/rerank", json={"query": query, "texts": documents, "documents": documents},
                         timeout=60)
    assert both.status_code == 400 and "exactly one of documents" in both.json()["error"]
    on_v1 = requests.post(f"{http_url}/v1/rerank", json={"query": query, "texts": documents}, timeout=60)
    assert on_v1.status_code == 400 and on_v1.json()["error"]["param"] == "texts"


def test_info_describes_the_default_embedding_model(http_url, pooling_info):
    info = requests.get(f"{http_url}/info", timeout=60).json()
    assert info["model_id"] == info["served_model_name"] == pooling_info.model
    assert info["model_type"] == {"embedding": {"pooling": pooling_info.pooling_mode}}
    assert (info["max_input_length"], info["max_batch_tokens"], info["max_client_batch_size"]) == (
        pooling_info.max_input_length, pooling_info.max_batch_tokens, pooling_info.max_batch_size)
    assert info["model_dtype"] == "float32" and info["auto_truncate"] is False


def test_vllm_score_equals_sentence_transformers_cosines(http_url, gateway, reference, pooling_info):
    """vLLM's /score on an embedding model: the cosine of each pair, one text against many or
    pairwise, in the pairs' order (equal to the gRPC Rerank's scores)."""
    query = "a cat"
    vectors = reference.encode([query, *TEXTS], normalize_embeddings=True, convert_to_numpy=True)
    expected = vectors[1:] @ vectors[0]
    for path in ("/score", "/v1/score"):
        reply = requests.post(f"{http_url}{path}", json={"text_1": query, "text_2": TEXTS}, timeout=120)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["object"] == "list" and answer["model"] == pooling_info.model and answer["usage"]["prompt_tokens"]
        assert [d["index"] for d in answer["data"]] == [0, 1, 2] and {d["object"] for d in answer["data"]} == {"score"}
        assert np.allclose([d["score"] for d in answer["data"]], expected, rtol=0, atol=1e-5)
    pairwise = requests.post(f"{http_url}/score", json={"text_1": [query] * 3, "text_2": TEXTS}, timeout=120).json()
    assert np.allclose([d["score"] for d in pairwise["data"]], expected, rtol=0, atol=1e-5)
    grpc_scores = gateway.Rerank(pooling_pb2.RerankRequest(query=query, documents=TEXTS), timeout=60)
    assert sorted(d["score"] for d in pairwise["data"]) == sorted(r.score for r in grpc_scores.results)
    mismatched = requests.post(f"{http_url}/score", json={"text_1": TEXTS[:2], "text_2": TEXTS}, timeout=60)
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_2"
    too_many = requests.post(f"{http_url}/score", json={"text_1": ["q"] * (pooling_info.max_batch_size + 1),
                                                        "text_2": ["d"] * (pooling_info.max_batch_size + 1)},
                             timeout=60)
    assert too_many.status_code == 400 and "max_batch_size" in too_many.json()["error"]["message"]
    long = requests.post(f"{http_url}/score", json={"text_1": query, "text_2": [LONG_TEXT]}, timeout=60)
    assert long.status_code == 400 and "set truncate to cut it" in long.json()["error"]["message"]
    cut = requests.post(f"{http_url}/score", json={"text_1": query, "text_2": [LONG_TEXT], "truncate": True},
                        timeout=60)
    assert cut.status_code == 200, cut.text
