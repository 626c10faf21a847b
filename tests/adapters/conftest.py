"""Real PEFT LoRA adapters on a tiny random Llama, built once per session."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))


def make_peft_adapter(directory: Path, seed: int = 0, **lora_kwargs):
    """Save a real PEFT adapter (non-zero A and B) to `directory`; returns the PEFT model."""
    lora_kwargs = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **lora_kwargs}
    model = tiny_llama()
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    peft_model.save_pretrained(str(directory))
    return peft_model


def edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("base")
    LlamaConfig(**TINY_LLAMA).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def plain_adapter(tmp_path_factory):
    """(directory, peft_model) of r=4, alpha=8 LoRA on q_proj and v_proj."""
    directory = tmp_path_factory.mktemp("plain") / "adapter"
    return directory, make_peft_adapter(directory)


@pytest.fixture()
def root(tmp_path) -> Path:
    directory = tmp_path / "root"
    directory.mkdir()
    return directory


@pytest.fixture()
def adapter_in_root(root, plain_adapter) -> Path:
    """A fresh copy of the plain adapter at <root>/plain (safe to edit)."""
    target = root / "plain"
    shutil.copytree(plain_adapter[0], target)
    return target


@pytest.fixture(scope="session")
def make_adapter():
    """`make_adapter(directory, seed=0, **lora_kwargs) -> peft_model` (see make_peft_adapter)."""
    return make_peft_adapter


@pytest.fixture(scope="session")
def edit_adapter_config():
    """`edit_adapter_config(directory, **changes)` rewrites adapter_config.json."""
    return edit_config
