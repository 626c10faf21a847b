"""Model families by config.json's `model_type`: one file each, loaded by name from safetensors."""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.checkpoint import DECODER_ARCHITECTURES, CheckpointConfig
from services.decoder.model_llama import LlamaForCausalLM, load_checkpoint
from services.decoder.model_qwen2 import Qwen2ForCausalLM
from services.decoder.model_qwen2_vl import is_qwen2_vl, load_qwen2_vl
from services.decoder.model_qwen3 import Qwen3ForCausalLM

# one entry per model_type of DECODER_ARCHITECTURES but qwen2_vl (its own loader below), which
# `check_decoder_dir` checks without importing torch
MODEL_FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def load_model(checkpoint: CheckpointConfig | str | Path, dtype: torch.dtype,
               mrope_section: tuple[int, int, int] | None = None) -> LlamaForCausalLM:
    """The causal LM of a checkpoint (Llama, Qwen2, Qwen3, or Qwen2-VL's language model).

    `checkpoint`: its config.json as read once by `DecoderConfig` (or a directory, read here).

    Raises:
        ValueError: no config.json, an unsupported model_type or configuration, weights that do not match.
    """
    if not isinstance(checkpoint, CheckpointConfig):
        checkpoint = CheckpointConfig.read(checkpoint)
    if is_qwen2_vl(checkpoint.raw):
        return load_qwen2_vl(checkpoint, dtype, mrope_section)
    if checkpoint.model_type not in MODEL_FAMILIES:
        supported = tuple(DECODER_ARCHITECTURES)
        raise ValueError(f"model_type {checkpoint.model_type!r} is not supported; expected one of {supported}")
    return load_checkpoint(MODEL_FAMILIES[checkpoint.model_type], checkpoint, dtype, mrope_section)
