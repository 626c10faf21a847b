"""Embed and Rerank through the gateway, against sentence-transformers."""

from __future__ import annotations

import base64

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from services.common.tensor import from_pb
from tessera.v1 import gateway_pb2, pooling_pb2

from .conftest import run_cli

TEXTS = [
    "A man is eating food.",
    "A man is riding a horse on a beach at sunset while the waves roll in and seagulls circle overhead. " * 6,
    "The new movie is awesome.",
    "Tessera serves embeddings over gRPC.",
    "x",
    "Paris is the capital and most populous city of France.",
    "Le chat est sur la table.",
]

RELEVANCE = [
    ("What is the capital of France?", "Paris is the capital and largest city of France.",
     ["Bananas are rich in potassium.", "The Pacific is the largest ocean.", "Python is a programming language."]),
    ("How many legs does a spider have?", "Spiders have eight legs.",
     ["The moon orbits the Earth.", "Bread is made from flour.", "Violins have four strings."]),
    ("Who painted the Mona Lisa?", "The Mona Lisa was painted by Leonardo da Vinci.",
     ["Mount Everest is in the Himalayas.", "Coffee contains caffeine.", "Rain falls from clouds."]),
    ("What gas do plants absorb for photosynthesis?", "Plants take in carbon dioxide to photosynthesize.",
     ["Gold is a metal.", "The guitar has six strings.", "Tokyo is in Japan."]),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level.",
     ["Cats are mammals.", "Shakespeare wrote Hamlet.", "The sun is a star."]),
]


@pytest.fixture(scope="session")
def sentence_transformer(embedding_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedding_dir), device="cpu")


def test_embeddings_equal_sentence_transformers_in_any_batch(gateway, sentence_transformer):
    expected = torch.from_numpy(sentence_transformer.encode(TEXTS, convert_to_numpy=True))
    batched = from_pb(gateway.Embed(pooling_pb2.EmbedRequest(inputs=TEXTS), timeout=120).embeddings)
    assert batched.shape == expected.shape == (len(TEXTS), 384)
    assert F.cosine_similarity(batched, expected).min() >= 0.99999
    for i, text in enumerate(TEXTS[:3]):
        alone = from_pb(gateway.Embed(pooling_pb2.EmbedRequest(inputs=[text]), timeout=120).embeddings)
        assert F.cosine_similarity(alone, expected[i : i + 1]).item() >= 0.99999
    assert torch.allclose(batched.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_base64_is_little_endian_float32(gateway, sentence_transformer):
    response = gateway.Embed(pooling_pb2.EmbedRequest(
        inputs=TEXTS[:2], encoding_format=pooling_pb2.ENCODING_FORMAT_BASE64), timeout=120)
    expected = sentence_transformer.encode(TEXTS[:2], convert_to_numpy=True)
    assert len(response.embeddings_base64) == 2
    for encoded, vector in zip(response.embeddings_base64, expected):
        decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
        assert decoded.shape == (384,)
        assert float(np.dot(decoded, vector) / np.linalg.norm(decoded) / np.linalg.norm(vector)) >= 0.99999


def test_default_rerank_puts_relevant_first(gateway):
    for query, relevant, distractors in RELEVANCE:
        documents = [*distractors[:1], relevant, *distractors[1:]]  # relevant at index 1
        response = gateway.Rerank(pooling_pb2.RerankRequest(query=query, documents=documents,
                                                            return_documents=True), timeout=120)
        assert response.method == "bi-encoder"
        assert [r.index for r in response.results][0] == 1, query
        assert sorted(r.index for r in response.results) == [0, 1, 2, 3]
        scores = [r.score for r in response.results]
        assert scores == sorted(scores, reverse=True)
        assert all(r.document == documents[r.index] for r in response.results)
        top = gateway.Rerank(pooling_pb2.RerankRequest(query=query, documents=documents, top_n=2), timeout=120)
        assert [r.index for r in top.results] == [r.index for r in response.results][:2]


def test_cli_embed_and_rerank(gateway_address):
    result = run_cli(gateway_address, "embed", "a cat", "a kitten", "stock market")
    assert result.returncode == 0, result.stderr
    assert "cosine similarity" in result.stdout
    result = run_cli(gateway_address, "rerank", "capital of France", "Bananas are yellow.",
                     "Paris is the capital of France.", "--top-n", "1", "--json")
    assert result.returncode == 0, result.stderr
    assert '"index": 1' in result.stdout and '"method": "bi-encoder"' in result.stdout
    long_text = "Paris is the capital of France. " * 80  # past all-MiniLM's 256 tokens
    refused = run_cli(gateway_address, "embed", long_text)
    assert refused.returncode != 0 and "set truncate to cut it" in refused.stderr
    assert run_cli(gateway_address, "embed", long_text, "--truncate").returncode == 0
    refused = run_cli(gateway_address, "rerank", "capital of France", long_text, "Bananas.")
    assert refused.returncode != 0 and "document 0 has" in refused.stderr
    cut = run_cli(gateway_address, "rerank", "capital of France", long_text, "Bananas.", "--truncate", "--json")
    assert cut.returncode == 0 and '"index": 0' in cut.stdout, cut.stderr


def test_tokenize_and_embed_stream_through_gateway(gateway, sentence_transformer):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sentence_transformer.tokenizer.name_or_path)
    model = gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=60).pooling.model  # "" is the decoder's
    response = gateway.Tokenize(pooling_pb2.TokenizeRequest(model=model, inputs=["Hello tessera"]), timeout=60)
    assert [t.id for t in response.results[0].tokens] == tokenizer("Hello tessera")["input_ids"]

    requests = [pooling_pb2.EmbedRequest(inputs=[text]) for text in TEXTS[:4]]
    responses = list(gateway.EmbedStream(iter(requests), timeout=120))
    streamed = torch.cat([from_pb(r.embeddings) for r in responses])
    expected = torch.from_numpy(sentence_transformer.encode(TEXTS[:4], convert_to_numpy=True))
    assert F.cosine_similarity(streamed, expected).min() >= 0.99999

    # a refused message, by pooling (no inputs) or by the gateway's caps (past max_batch_size): the
    # messages before it are answered, then the stream ends with INVALID_ARGUMENT
    from services.common.limits import PoolingLimits

    over_cap = pooling_pb2.EmbedRequest(inputs=["a"] * (PoolingLimits().max_batch_size + 1))
    for refused in (pooling_pb2.EmbedRequest(inputs=[]), over_cap):
        answered = []
        with pytest.raises(grpc.RpcError) as error:
            for response in gateway.EmbedStream(iter([pooling_pb2.EmbedRequest(inputs=["fine"]), refused]), timeout=60):
                answered.append(response)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(answered) == 1 and from_pb(answered[0].embeddings).shape[0] == 1
