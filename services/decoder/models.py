"""Model families by config.json's `model_type`: one file each, loaded by name from safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.decoder.model_llama import LlamaForCausalLM, load_checkpoint
from services.decoder.model_qwen2 import Qwen2ForCausalLM
from services.decoder.model_qwen2_vl import is_qwen2_vl, load_qwen2_vl
from services.decoder.model_qwen3 import Qwen3ForCausalLM

MODEL_FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def load_model(model_dir: str | Path, dtype: torch.dtype,
               mrope_section: tuple[int, int, int] | None = None) -> LlamaForCausalLM:
    """The causal LM of `model_dir` (Llama, Qwen2, Qwen3, or Qwen2-VL's language model).

    Raises:
        ValueError: no config.json, an unsupported model_type or configuration, weights that do not match.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model_dir {str(model_dir)!r} has no config.json")
    cfg = json.loads(path.read_text())
    if is_qwen2_vl(cfg):
        return load_qwen2_vl(model_dir, dtype, mrope_section)
    model_type = cfg.get("model_type")
    if model_type not in MODEL_FAMILIES:
        supported = (*MODEL_FAMILIES, "qwen2_vl")
        raise ValueError(f"model_type {model_type!r} is not supported; expected one of {supported}")
    return load_checkpoint(MODEL_FAMILIES[model_type], model_dir, dtype, mrope_section)
