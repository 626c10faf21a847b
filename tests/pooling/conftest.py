"""Shared fixtures for the pooling tests: the prepared all-MiniLM-L6-v2 encoder, loaded once."""

from __future__ import annotations

import pytest

from services.common.paths import default_embedding_dir
from services.pooling.config import PoolingConfig
from services.pooling.encoder import HFEncoder


@pytest.fixture(scope="session")
def minilm_dir():
    return default_embedding_dir()


@pytest.fixture(scope="session")
def minilm_config(minilm_dir) -> PoolingConfig:
    return PoolingConfig(model_dir=minilm_dir)


@pytest.fixture(scope="session")
def minilm_encoder(minilm_config) -> HFEncoder:
    c = minilm_config
    return HFEncoder(c.model_dir, c.max_input_length, c.device, c.do_lower_case)
