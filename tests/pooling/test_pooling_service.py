"""`PoolingEngine` on the prepared all-MiniLM-L6-v2, checked against sentence-transformers."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer

from services.common.errors import InvalidArgument, NotFound, Unavailable
from services.pooling.config import ModelConfig, PoolingConfig
from services.pooling.convert import check_tokenize_fields, embeddings_to_pb, info_to_pb
from services.pooling.engine import PoolingEngine
from tessera.v1 import decoder_pb2, pooling_pb2

SHORT = "A cat sat on the mat."
LONG = " ".join(f"Sentence number {i} talks about rivers, mountains and the weather in spring." for i in range(14))
BATCH = [SHORT, "Hello world", "Quantum computers use qubits.", LONG[:300], "Paris is in France.",
         "I like green tea.", "The quick brown fox jumps over the lazy dog."]

FACTS = [  # (query, documents, index of the relevant one)
    ("What is the capital of France?",
     ["The Great Barrier Reef lies off the coast of Queensland.", "Paris is the capital and largest city of France.",
      "Photosynthesis converts light energy into chemical energy.", "The stock market closed higher on Tuesday."], 1),
    ("How many legs does a spider have?",
     ["Spiders are arachnids with eight legs.", "The Eiffel Tower was completed in 1889.",
      "Bread is made from flour, water and yeast.", "Jupiter is the largest planet in the solar system."], 0),
    ("Who wrote Romeo and Juliet?",
     ["The Amazon river flows through Brazil.", "Coffee contains caffeine.", "Violins have four strings.",
      "Romeo and Juliet is a tragedy written by William Shakespeare."], 3),
    ("What temperature does water boil at sea level?",
     ["Penguins live mostly in the Southern Hemisphere.", "The piano has 88 keys.",
      "At sea level, water boils at 100 degrees Celsius.", "Mount Everest is in the Himalayas."], 2),
]


@pytest.fixture(scope="module")
def st_model(minilm_dir):
    return SentenceTransformer(str(minilm_dir), device="cpu")


def _service(config, loaded):
    return PoolingEngine(config, models={loaded.name: loaded})


@pytest.fixture(scope="module")
def service(minilm_config, minilm_loaded):
    return _service(minilm_config, minilm_loaded)


def _embed(service, texts, **kwargs):
    return asyncio.run(service.embed(texts, **kwargs))


def _cosine(a, b):
    return F.cosine_similarity(torch.as_tensor(a).float(), torch.as_tensor(b).float(), dim=-1)


LONG_400 = " ".join(f"Paragraph {i} describes the history of ancient trade routes across deserts." for i in range(34))
BATCH_32 = [f"Sentence {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4]) * (1 + i % 5) for i in range(32)]


def test_long_texts_are_long(minilm_loaded):
    num_tokens = [len(s) for s in minilm_loaded.tokenizer.encode_texts([LONG, LONG_400], truncate=True)]
    assert 180 <= num_tokens[0] <= 256, num_tokens
    assert len(minilm_loaded.tokenizer.tokenizer(LONG_400)["input_ids"]) in range(400, 430)


@pytest.mark.parametrize("texts", [[SHORT], [SHORT, LONG], [LONG, SHORT], [SHORT, LONG_400], BATCH, BATCH_32],
                         ids=["alone", "short+long", "long+short", "short+400-tokens", "batch7", "batch32"])
def test_embeddings_equal_sentence_transformers(service, st_model, texts):
    # sentence-transformers cuts the 400-token text to max_seq_length 256; truncate=True does the same
    result = _embed(service, texts, truncate=True)
    reference = torch.from_numpy(st_model.encode(texts, convert_to_numpy=True))
    assert result.vectors.shape == (len(texts), 384) and result.vectors.dtype == torch.float32
    assert (_cosine(result.vectors, reference) >= 0.99999).all()
    torch.testing.assert_close(result.vectors.norm(dim=-1), torch.ones(len(texts)))  # the model's Normalize module


def test_result_does_not_depend_on_batch_composition(service):
    alone = _embed(service, [SHORT]).vectors[0]
    beside_long = _embed(service, [LONG, SHORT]).vectors[1]
    in_batch = _embed(service, BATCH).vectors[0]
    torch.testing.assert_close(beside_long, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(in_batch, alone, atol=1e-5, rtol=0)


def test_usage_counts_visible_tokens_only(service, st_model):
    counts = [len(st_model.tokenizer(text)["input_ids"]) for text in [SHORT, LONG]]
    assert _embed(service, [SHORT, LONG]).num_prompt_tokens == sum(counts)
    assert _embed(service, [SHORT]).num_prompt_tokens == counts[0]


def test_normalize_override(service):
    raw = _embed(service, [SHORT, LONG], normalize=False).vectors
    unit = _embed(service, [SHORT, LONG]).vectors
    assert ((raw.norm(dim=-1) - 1).abs() > 1e-2).all()  # mean-pooled MiniLM vectors are not unit length
    torch.testing.assert_close(F.normalize(raw, dim=-1), unit)


def test_base64_decodes_to_the_float_vectors(service):
    result = _embed(service, [SHORT, LONG])
    response = embeddings_to_pb(result, pooling_pb2.ENCODING_FORMAT_BASE64)
    assert len(response.embeddings_base64) == 2 and not response.HasField("embeddings")
    for row, encoded in enumerate(response.embeddings_base64):
        decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
        assert decoded.shape == (384,)
        assert np.array_equal(decoded, result.vectors[row].numpy())
    assert response.usage.prompt_tokens == response.usage.total_tokens == result.num_prompt_tokens


@pytest.mark.parametrize("query, documents, relevant", FACTS, ids=[f[0][:20] for f in FACTS])
def test_rerank_puts_the_relevant_document_first(service, query, documents, relevant):
    ranking = asyncio.run(service.rerank(query, documents))
    assert ranking.method == "bi-encoder"
    assert ranking.results[0].index == relevant
    assert sorted(r.index for r in ranking.results) == [0, 1, 2, 3]
    scores = [r.score for r in ranking.results]
    assert scores == sorted(scores, reverse=True)
    assert all(r.document is None for r in ranking.results)


def test_rerank_scores_are_cosines_of_st_embeddings(service, st_model):
    query, documents, _ = FACTS[0]
    ranking = asyncio.run(service.rerank(query, documents))
    vectors = torch.from_numpy(st_model.encode([query, *documents]))
    expected = _cosine(vectors[1:], vectors[0:1])
    for r in ranking.results:
        assert abs(r.score - float(expected[r.index])) < 1e-5


def test_rerank_top_n_and_documents(service):
    query, documents, relevant = FACTS[2]
    full = asyncio.run(service.rerank(query, documents))
    top = asyncio.run(service.rerank(query, documents, top_n=2, return_documents=True))
    assert [r.index for r in top.results] == [r.index for r in full.results[:2]]
    assert top.results[0].index == relevant
    assert [r.document for r in top.results] == [documents[r.index] for r in top.results]
    assert len(asyncio.run(service.rerank(query, documents, top_n=4)).results) == 4
    # more than there are documents: all of them, sorted (clamped, as TEI and vLLM do)
    clamped = asyncio.run(service.rerank(query, documents, top_n=len(documents) + 5))
    assert [(r.index, r.score) for r in clamped.results] == [(r.index, r.score) for r in full.results]
    assert len(clamped.results) == len(documents)
    assert [r.score for r in clamped.results] == sorted((r.score for r in clamped.results), reverse=True)


def test_rerank_ties_break_by_index(service):
    documents = ["Dogs bark.", "Paris is in France.", "Dogs bark.", "Paris is in France."]
    ranking = asyncio.run(service.rerank("Where is Paris?", documents))
    assert [r.index for r in ranking.results] == [1, 3, 0, 2]


def test_concurrent_requests_get_their_own_results(service):
    fresh = service

    async def run_all():
        return await asyncio.gather(fresh.embed([SHORT]), fresh.embed([LONG, SHORT]), fresh.embed(BATCH))

    results = asyncio.run(run_all())
    torch.testing.assert_close(results[0].vectors, _embed(service, [SHORT]).vectors)
    torch.testing.assert_close(results[2].vectors, _embed(service, BATCH).vectors)


# --- errors -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(minilm_model_config, minilm_loaded):
    return _service(PoolingConfig(models=[minilm_model_config], max_batch_size=3, max_request_chars=2000), minilm_loaded)


@pytest.mark.parametrize("call, message", [
    (lambda s: s.embed([]), "inputs is empty; send at least one text"),
    (lambda s: s.embed(["ok", ""]), r"inputs\[1\] is an empty string"),
    (lambda s: s.embed(["a", "b", "c", "d"]), "request has 4 inputs; max_batch_size is 3"),
    (lambda s: s.embed(["ok", "word " * 300]), r"input 1 has 302 tokens; the maximum input length is 256 \(set truncate"),
    (lambda s: s.rerank("", ["a doc"]), "query must be a non-empty string"),
    (lambda s: s.rerank("q", []), "documents is empty; send at least one text"),
    (lambda s: s.rerank("q", ["a", ""]), r"documents\[1\] is an empty string"),
    (lambda s: s.rerank("q", ["a", "b", "c", "d"]), "request has 4 documents; max_batch_size is 3"),
    (lambda s: s.rerank("q", ["a", "b"], top_n=0), r"top_n must be >= 1 \(or unset for all 2 documents\), got 0"),
    (lambda s: s.rerank("q", ["a", "b"], top_n=-1), "got -1"),
    (lambda s: s.rerank("word " * 300, ["a"]), r"query has 302 tokens.*\(set truncate to cut it"),
    (lambda s: s.rerank("q", ["a", "word " * 300]), r"document 1 has 302 tokens.*\(set truncate to cut it"),
    (lambda s: s.embed(["x" * 1000, "y" * 1001]), r"2001 characters of text; the limit is 2000 \(max_request_chars\)"),
    (lambda s: s.rerank("q" * 1000, ["z" * 1001]), r"2001 characters of text; the limit is 2000"),
    (lambda s: s.tokenize(["t" * 2001]), r"2001 characters of text"),
    (lambda s: s.embed(["ok"], dimensions=64), "not trained for Matryoshka truncation; leave dimensions unset"),
    (lambda s: s.embed(["ok"], truncation_direction="middle"), "truncation direction must be one of"),
    (lambda s: s.embed(["ok"], prompt_name="query"), "has no prompt 'query'"),
    (lambda s: s.embed(token_ids=((101, 99999, 102),)), r"id 99999, outside the vocabulary \[0, 30522\)"),
    (lambda s: s.embed(token_ids=((),)), r"input_ids\[0\] is an empty id list; every input must hold at least one"),
    (lambda s: s.embed(token_ids=((101, 102), ())), r"input_ids\[1\] is an empty id list"),
    (lambda s: s.rerank("q", ["a"], method="cross-encoder"), "reranks by 'bi-encoder'; 'cross-encoder' needs a model"),
], ids=["no-inputs", "empty-input", "too-many", "too-long", "empty-query", "no-docs", "empty-doc", "too-many-docs",
        "top-n-0", "top-n-negative", "long-query", "long-doc", "embed-chars", "rerank-chars",
        "tokenize-chars"]
    + ["dimensions", "direction", "prompt", "bad-id", "empty-ids", "second-empty-ids", "rerank-method"])
def test_invalid_requests(small, call, message):
    with pytest.raises(InvalidArgument, match=message):
        asyncio.run(call(small))


def test_model_name(small):
    with pytest.raises(NotFound, match="'other-model' is not served here"):
        asyncio.run(small.embed(["hi"], model="other-model"))
    with pytest.raises(NotFound):
        asyncio.run(small.rerank("q", ["a"], model="other-model"))
    assert asyncio.run(small.embed(["hi"], model="all-minilm-l6-v2")).vectors.shape == (1, 384)


def test_not_loaded_is_unavailable(minilm_config):
    with pytest.raises(Unavailable):
        asyncio.run(PoolingEngine(minilm_config).embed(["hi"]))


def test_info(small):
    info = small.info()
    assert (info.model, info.pooling_mode, info.normalize, info.dimension, info.max_input_length,
            info.max_batch_size, info.rerank_method) == ("all-minilm-l6-v2", "mean", True, 384, 256, 3, "bi-encoder")
    assert (info.max_batch_tokens, info.max_queue_size, info.dynamic_batching) == (16384, 4096, True)
    [model] = info.models
    assert (model.kind, model.matryoshka, model.dimension) == ("embedding", False, 384)


def test_served_names_and_aliases_address_the_model_and_answers_carry_the_first(minilm_dir, minilm_loaded):
    """--served-model-name NAME ALIAS: requests may give either; the directory name is then unknown
    (NotFound, as vLLM); answers and info carry NAME, info lists the alias."""
    config = PoolingConfig(models=[ModelConfig(model_dir=minilm_dir, model_name="org/minilm", aliases=("minilm",))])
    engine = PoolingEngine(config, models={"org/minilm": minilm_loaded})
    for name in ("", "org/minilm", "minilm"):
        assert asyncio.run(engine.embed(["hi"], model=name)).model == "org/minilm"
        assert asyncio.run(engine.rerank("q", ["a"], model=name)).model == "org/minilm"
        assert asyncio.run(engine.tokenize(["hi"], model=name)).model == "org/minilm"
    with pytest.raises(NotFound, match=r"'all-minilm-l6-v2' is not served here; .* \['minilm', 'org/minilm'\]"):
        asyncio.run(engine.embed(["hi"], model="all-minilm-l6-v2"))
    info = info_to_pb(engine.info())
    assert info.model == "org/minilm"
    assert [(m.model, list(m.aliases)) for m in info.models] == [("org/minilm", ["minilm"])]


@pytest.mark.parametrize("fields", [
    {"messages": [decoder_pb2.ChatMessage(role="user")]}, {"add_generation_prompt": False},
    {"continue_final_message": True}, {"chat_template_kwargs": "{}"}])
def test_tokenize_refuses_the_chat_template_fields_rather_than_dropping_them(fields):
    [name] = fields
    with pytest.raises(InvalidArgument, match=f"^{name} is for decoder models"):
        check_tokenize_fields(pooling_pb2.TokenizeRequest(inputs=["hi"], **fields))
    check_tokenize_fields(pooling_pb2.TokenizeRequest(inputs=["hi"], add_special_tokens=False, prompt_name="q"))
