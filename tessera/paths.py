"""Where tessera keeps prepared models: one configurable directory (`TESSERA_HOME`)."""

from __future__ import annotations

import os
from pathlib import Path

from tessera.protocol import HOME_ENV

DECODER_MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"


def tessera_home() -> Path:
    """`$TESSERA_HOME`, default `~/.cache/tessera`."""
    return Path(os.environ.get(HOME_ENV, Path.home() / ".cache" / "tessera")).expanduser()


def models_dir() -> Path:
    return tessera_home() / "models"


def default_decoder_dir() -> Path:
    return models_dir() / DECODER_MODEL


def default_embedding_dir() -> Path:
    return models_dir() / EMBEDDING_MODEL


def default_adapter_root() -> Path:
    return tessera_home() / "adapters"


def cluster_home(name: str) -> Path:
    """One cluster's own directory, `$TESSERA_HOME/clusters/NAME`: its logs and its adapter catalog, so
    that two clusters on one host (`tessera up --cluster NAME`, default the gateway's port) never share
    either. Models stay shared under `models_dir()`."""
    return tessera_home() / "clusters" / name
