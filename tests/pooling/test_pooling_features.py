"""Truncation, token-id inputs, Matryoshka dimensions, prompts and Tokenize on the prepared MiniLM."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from services.common.errors import InvalidArgument
from services.pooling.config import ModelConfig, PoolingConfig
from services.pooling.engine import PoolingEngine, ServedModel

SHORT = "A cat sat on the mat."
LONG = " ".join(f"Paragraph {i} describes the history of ancient trade routes across deserts." for i in range(34))


def _service(model_config, loaded):
    served = ServedModel(model_config, loaded.tokenizer, loaded.runner)  # same weights, this model's config
    return PoolingEngine(PoolingConfig(models=[model_config]), models={model_config.model_name: served})


@pytest.fixture(scope="module")
def service(minilm_config, minilm_loaded):
    return PoolingEngine(minilm_config, models={minilm_loaded.name: minilm_loaded})


@pytest.fixture(scope="module")
def hf_tokenizer(minilm_loaded):
    return minilm_loaded.tokenizer.tokenizer


def _embed(service, texts=None, **kwargs):
    return asyncio.run(service.embed(texts, **kwargs))


def test_token_ids_equal_text(service, hf_tokenizer):
    ids = tuple(hf_tokenizer(SHORT)["input_ids"])
    by_ids = _embed(service, token_ids=(ids,))
    by_text = _embed(service, [SHORT])
    torch.testing.assert_close(by_ids.vectors, by_text.vectors, atol=1e-6, rtol=0)
    assert by_ids.num_prompt_tokens == by_text.num_prompt_tokens == len(ids)


def test_truncation_directions(service, hf_tokenizer):
    ids = hf_tokenizer(LONG)["input_ids"]
    assert len(ids) > 400
    right = _embed(service, [LONG], truncate=True)
    left = _embed(service, [LONG], truncate=True, truncation_direction="left")
    # references: the tokenizer's own truncation keeps [CLS] ... [SEP] around the first / last 254 tokens
    first = tuple(ids[:255] + ids[-1:])
    last = tuple(ids[:1] + ids[-255:])
    torch.testing.assert_close(right.vectors, _embed(service, token_ids=(first,)).vectors, atol=1e-6, rtol=0)
    torch.testing.assert_close(left.vectors, _embed(service, token_ids=(last,)).vectors, atol=1e-6, rtol=0)
    assert right.num_prompt_tokens == left.num_prompt_tokens == 256
    assert F.cosine_similarity(right.vectors, left.vectors).item() < 0.999  # different text kept
    cut_ids = _embed(service, token_ids=(tuple(ids),), truncate=True, truncation_direction="left")
    torch.testing.assert_close(cut_ids.vectors, _embed(service, token_ids=(tuple(ids[-256:]),)).vectors, atol=1e-6, rtol=0)
    with pytest.raises(InvalidArgument, match=f"input 0 has {len(ids)} tokens; the maximum input length is 256"):
        _embed(service, [LONG])


def test_matryoshka_dimensions_truncate_then_normalize(minilm_dir, minilm_loaded, service):
    mrl = _service(ModelConfig(model_dir=minilm_dir, matryoshka_dimensions=(64, 128)), minilm_loaded)
    raw = _embed(service, [SHORT, LONG], normalize=False, truncate=True).vectors
    small = _embed(mrl, [SHORT, LONG], dimensions=64, truncate=True)
    assert small.vectors.shape == (2, 64)
    torch.testing.assert_close(small.vectors, F.normalize(raw[:, :64], dim=-1), atol=1e-6, rtol=0)
    unnormalized = _embed(mrl, [SHORT], dimensions=128, normalize=False).vectors
    torch.testing.assert_close(unnormalized, raw[:1, :128], atol=1e-6, rtol=0)
    with pytest.raises(InvalidArgument, match=r"dimensions 100 is not one of .* trained widths \[64, 128\]"):
        _embed(mrl, [SHORT], dimensions=100)
    with pytest.raises(InvalidArgument, match="not trained for Matryoshka"):
        _embed(service, [SHORT], dimensions=64)


def test_prompts_prefix_the_text(minilm_dir, minilm_loaded, service):
    prompted = _service(ModelConfig(model_dir=minilm_dir, prompts={"query": "query: ", "document": "passage: "}),
                        minilm_loaded)
    with_prompt = _embed(prompted, [SHORT], prompt_name="query")
    torch.testing.assert_close(with_prompt.vectors, _embed(service, ["query: " + SHORT]).vectors, atol=1e-6, rtol=0)
    torch.testing.assert_close(_embed(prompted, [SHORT]).vectors, _embed(service, [SHORT]).vectors)  # no default prompt
    tokens = asyncio.run(prompted.tokenize([SHORT], prompt_name="query")).results[0]
    assert [t.text for t in tokens[:3]] == ["[CLS]", "query", ":"]


def test_tokenize(service):
    result = asyncio.run(service.tokenize(["A cat", "Hello world!"]))
    assert result.model == "all-minilm-l6-v2"
    first = result.results[0]
    assert [(t.id, t.text, t.special, t.start, t.stop) for t in first] == [
        (101, "[CLS]", True, 0, 0), (1037, "a", False, 0, 1), (4937, "cat", False, 2, 5), (102, "[SEP]", True, 0, 0)]
    bare = asyncio.run(service.tokenize(["Hello world!"], add_special_tokens=False)).results[0]
    assert [t.text for t in bare] == ["hello", "world", "!"] and not any(t.special for t in bare)
    with pytest.raises(InvalidArgument, match="empty string"):
        asyncio.run(service.tokenize(["ok", ""]))
