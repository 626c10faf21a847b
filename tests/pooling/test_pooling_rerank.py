"""Cross-encoder and LLM-judge reranking, last-token embeddings, several models in one service."""

from __future__ import annotations

import asyncio

import pytest
import torch
from sentence_transformers import CrossEncoder
from transformers import AutoTokenizer, LlamaForCausalLM

from services.common.errors import InvalidArgument, NotFound
from services.pooling.config import EMBEDDING, LLM_JUDGE, ModelConfig, PoolingConfig
from services.pooling.engine import PoolingEngine, load_served_model

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "Bananas are yellow.",
             "The Eiffel Tower was completed in 1889 and is a famous landmark of the French capital city.",
             "Rust is a programming language.", "x"]
TEXTS = ["Hi", "A somewhat longer sentence about the weather today.", "Mixed lengths: one, two, three, four, five, six."]


@pytest.fixture(scope="module")
def cluster(tiny_cross_encoder_dir, tiny_decoder_dir, minilm_model_config, minilm_loaded):
    """MiniLM (default embedder), a cross-encoder, an LLM judge and a last-token decoder embedder."""
    models = [minilm_model_config, ModelConfig(model_dir=tiny_cross_encoder_dir),
              ModelConfig(model_dir=tiny_decoder_dir, kind=LLM_JUDGE),
              ModelConfig(model_dir=tiny_decoder_dir, kind=EMBEDDING, model_name="tiny-decoder-embed")]
    loaded = {m.model_name: (minilm_loaded if m is minilm_model_config else load_served_model(m)) for m in models}
    return PoolingEngine(PoolingConfig(models=models, max_wait_ms=20), models=loaded)


def _rerank(service, **kwargs):
    return asyncio.run(service.rerank(QUERY, DOCUMENTS, **kwargs))


def test_model_kinds_and_defaults(cluster):
    info = cluster.info()
    assert [(m.model, m.kind, m.rerank_method, m.pooling_mode) for m in info.models] == [
        ("all-minilm-l6-v2", "embedding", "bi-encoder", "mean"),
        ("tiny-cross-encoder", "cross-encoder", "cross-encoder", "cls"),
        ("tiny-decoder", "llm-judge", "llm-judge", "last"),
        ("tiny-decoder-embed", "embedding", "bi-encoder", "last")]
    assert (info.model, info.rerank_method) == ("all-minilm-l6-v2", "cross-encoder")  # default embedder, default reranker
    assert _rerank(cluster).method == "cross-encoder"
    assert _rerank(cluster, model="all-minilm-l6-v2").method == "bi-encoder"


def test_cross_encoder_ranks_like_sentence_transformers(cluster, tiny_cross_encoder_dir):
    reference = CrossEncoder(str(tiny_cross_encoder_dir), device="cpu")
    pairs = [(QUERY, d) for d in DOCUMENTS]
    expected = torch.as_tensor(reference.predict(pairs, convert_to_numpy=True))  # sigmoid of the one logit
    expected_raw = torch.as_tensor(reference.predict(pairs, activation_fn=torch.nn.Identity(), convert_to_numpy=True))
    ranking = _rerank(cluster, model="tiny-cross-encoder")
    raw = _rerank(cluster, model="tiny-cross-encoder", raw_scores=True)
    assert ranking.method == "cross-encoder"
    expected_order = sorted(range(len(DOCUMENTS)), key=lambda i: (-float(expected[i]), i))
    assert [r.index for r in ranking.results] == expected_order
    assert [r.index for r in raw.results] == expected_order
    for r in ranking.results:
        assert abs(r.score - float(expected[r.index])) < 1e-5
    for r in raw.results:
        assert abs(r.score - float(expected_raw[r.index])) < 1e-5
    assert not torch.allclose(expected, expected_raw)  # the activation really is applied
    top = _rerank(cluster, model="tiny-cross-encoder", top_n=2, return_documents=True)
    assert [(r.index, r.document) for r in top.results] == [(i, DOCUMENTS[i]) for i in expected_order[:2]]


@pytest.mark.parametrize("direction", ["right", "left"])
def test_cross_encoder_truncation_equals_sentence_transformers(cluster, tiny_cross_encoder_dir, direction):
    """truncate cuts a long pair to max_input_length from the longer of query and document first, at
    `direction`'s end: CrossEncoder's own truncation (longest_first) with the same max_length."""
    limit = next(m.max_input_length for m in cluster.info().models if m.model == "tiny-cross-encoder")
    query = "capital of France " * 30  # both long: the longer one is cut first, then both in turn
    documents = ["Paris is the capital and largest city of France. " * 20, "Bananas are yellow.", "tower " * 300]
    reference = CrossEncoder(str(tiny_cross_encoder_dir), device="cpu", max_length=limit)
    reference.tokenizer.truncation_side = direction
    pairs = [(query, d) for d in documents]
    assert max(len(reference.tokenizer(q, d)["input_ids"]) for q, d in pairs) > limit  # truncation really happens
    expected = reference.predict(pairs, activation_fn=torch.nn.Identity(), convert_to_numpy=True)
    with pytest.raises(InvalidArgument, match=r"the pair \(query, document 0\) has \d+ tokens; the maximum input length is .*set truncate"):
        asyncio.run(cluster.rerank(query, documents, model="tiny-cross-encoder"))
    ranking = asyncio.run(cluster.rerank(query, documents, model="tiny-cross-encoder", raw_scores=True, truncate=True,
                                         truncation_direction=direction))
    assert sorted(r.index for r in ranking.results) == [0, 1, 2]
    for r in ranking.results:
        assert abs(r.score - float(expected[r.index])) < 1e-5, (r.index, r.score, expected)
    assert ranking.num_prompt_tokens == sum(len(reference.tokenizer(q, d, truncation=True, max_length=limit)["input_ids"])
                                            for q, d in pairs)


def test_truncated_bi_encoder_rerank_equals_truncated_embeddings(cluster):
    long_document = "Paris is the capital and largest city of France. " * 40
    embedded = asyncio.run(cluster.embed([QUERY, long_document], truncate=True, truncation_direction="left"))
    vectors = torch.nn.functional.normalize(embedded.vectors, dim=-1)
    ranking = asyncio.run(cluster.rerank(QUERY, [long_document], model="all-minilm-l6-v2", truncate=True,
                                         truncation_direction="left"))
    assert abs(ranking.results[0].score - float(vectors[1] @ vectors[0])) < 1e-5


def test_llm_judge_prompt_is_never_cut(cluster):
    with pytest.raises(InvalidArgument, match=r"the judge prompt of the query and document 0 has .*\(an llm-judge prompt is never cut"):
        asyncio.run(cluster.rerank(QUERY, ["word " * 400], model="tiny-decoder", truncate=True))


def test_llm_judge_equals_manual_yes_minus_no(cluster, tiny_decoder_dir):
    model = LlamaForCausalLM.from_pretrained(str(tiny_decoder_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_decoder_dir))
    config = cluster.config.models[2]
    yes, no = (tokenizer.convert_tokens_to_ids(t) for t in ("yes", "no"))
    w = model.lm_head.weight
    expected = []
    with torch.no_grad():
        for document in DOCUMENTS:
            prompt = config.judge_template.format(instruction=config.judge_instruction, query=QUERY, document=document)
            ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
            h = model.model(input_ids=ids).last_hidden_state[0, -1]  # [H], unpadded, alone
            expected.append(float(h @ w[yes] - h @ w[no]))
    raw = _rerank(cluster, model="tiny-decoder", raw_scores=True)
    prob = _rerank(cluster, model="tiny-decoder")
    assert raw.method == prob.method == "llm-judge"
    expected_order = sorted(range(len(DOCUMENTS)), key=lambda i: (-expected[i], i))
    assert [r.index for r in raw.results] == expected_order
    for r in raw.results:
        assert abs(r.score - expected[r.index]) < 1e-5
    for r in prob.results:
        assert abs(r.score - torch.sigmoid(torch.tensor(expected[r.index])).item()) < 1e-6


def test_last_token_pooling_equals_manual_reference(cluster, tiny_decoder_dir):
    model = LlamaForCausalLM.from_pretrained(str(tiny_decoder_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_decoder_dir))
    with torch.no_grad():
        expected = torch.stack([model.model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, -1] for t in TEXTS])
    lengths = {len(tokenizer(t)["input_ids"]) for t in TEXTS}
    assert len(lengths) == len(TEXTS)  # mixed lengths: the batch is right-padded
    result = asyncio.run(cluster.embed(TEXTS, model="tiny-decoder-embed"))  # no Normalize module: raw vectors
    assert result.vectors.shape == (3, 32)
    torch.testing.assert_close(result.vectors, expected, atol=1e-5, rtol=0)
    normalized = asyncio.run(cluster.embed(TEXTS, model="tiny-decoder-embed", normalize=True))
    torch.testing.assert_close(normalized.vectors, torch.nn.functional.normalize(expected, dim=-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("call, error, message", [
    (lambda s: s.embed(["x"], model="tiny-cross-encoder"), InvalidArgument, "is a cross-encoder reranker; Embed needs"),
    (lambda s: s.embed(["x"], model="nope"), NotFound, "'nope' is not served here"),
    (lambda s: s.rerank("q", ["a"], model="nope"), NotFound, "not served"),
    (lambda s: s.rerank("q", ["a"], model="tiny-decoder-embed", method="cross-encoder"), InvalidArgument,
     "is a embedding model and reranks by 'bi-encoder'"),
    (lambda s: s.rerank("q " * 300, ["a"], model="tiny-cross-encoder"), InvalidArgument,
     r"the pair \(query, document 0\) has 30[0-9] tokens"),
], ids=["embed-on-reranker", "unknown-embed", "unknown-rerank", "method-mismatch", "long-pair"])
def test_errors(cluster, call, error, message):
    with pytest.raises(error, match=message):
        asyncio.run(call(cluster))
