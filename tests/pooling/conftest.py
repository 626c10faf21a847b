"""Shared fixtures: the prepared all-MiniLM-L6-v2 (loaded once) and tiny random models saved to disk."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

from services.pooling.config import ModelConfig, PoolingConfig
from services.pooling.engine import load_served_model
from tessera.paths import default_decoder_dir, default_embedding_dir


@pytest.fixture(scope="session")
def minilm_dir():
    return default_embedding_dir()


@pytest.fixture(scope="session")
def minilm_model_config(minilm_dir) -> ModelConfig:
    return ModelConfig(model_dir=minilm_dir)


@pytest.fixture(scope="session")
def minilm_config(minilm_model_config) -> PoolingConfig:
    return PoolingConfig(models=[minilm_model_config])


@pytest.fixture(scope="session")
def minilm_loaded(minilm_model_config):
    """The loaded MiniLM (tokenizer + runner), shared by every service a test builds."""
    return load_served_model(minilm_model_config)


@pytest.fixture(scope="session")
def tiny_cross_encoder_dir(tmp_path_factory, minilm_dir):
    """A random 2-layer BertForSequenceClassification (one label) with the MiniLM WordPiece vocabulary."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1)
    d = tmp_path_factory.mktemp("tiny-ce") / "tiny-cross-encoder"
    BertForSequenceClassification(config).eval().save_pretrained(d)
    AutoTokenizer.from_pretrained(str(minilm_dir)).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_decoder_dir(tmp_path_factory):
    """A random 2-layer LlamaForCausalLM (hidden 32, untied LM head) with the SmolLM2 tokenizer."""
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("tiny-dec") / "tiny-decoder"
    LlamaForCausalLM(config).eval().save_pretrained(d)
    AutoTokenizer.from_pretrained(str(default_decoder_dir())).save_pretrained(d)
    return d
