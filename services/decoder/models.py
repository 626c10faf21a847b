"""Model families by config.json's `model_type`: one file each, loaded by name from safetensors.

`MODEL_FAMILIES` names each family's class as "module:Class" and imports it when a checkpoint of
that family loads, so one family's file (and what it imports) costs nothing to the others.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from services.common.checkpoint import DECODER_ARCHITECTURES, CheckpointConfig, decoder_impl
from services.decoder.model_llama import LlamaAttention, LlamaForCausalLM, load_checkpoint, quantized_types
from services.decoder.model_qwen2_vl import is_qwen2_vl, load_qwen2_vl

# one entry per model_type of DECODER_ARCHITECTURES but the Qwen2-VL family's (its own loader below), which
# `check_decoder_dir` checks without importing torch
MODEL_FAMILIES: dict[str, str] = {
    "llama": "services.decoder.model_llama:LlamaForCausalLM",
    "qwen2": "services.decoder.model_qwen2:Qwen2ForCausalLM",
    "qwen3": "services.decoder.model_qwen3:Qwen3ForCausalLM",
    "mistral": "services.decoder.model_mistral:MistralForCausalLM",
    "mixtral": "services.decoder.model_mixtral:MixtralForCausalLM",
    "qwen3_moe": "services.decoder.model_qwen3_moe:Qwen3MoeForCausalLM",
    "qwen2_moe": "services.decoder.model_qwen3_moe:Qwen2MoeForCausalLM",
    "smollm3": "services.decoder.model_smollm3:SmolLM3ForCausalLM",
    "granite": "services.decoder.model_granite:GraniteForCausalLM",
    "olmo2": "services.decoder.model_olmo2:Olmo2ForCausalLM",
    "gemma": "services.decoder.model_gemma:GemmaForCausalLM",
    "gemma2": "services.decoder.model_gemma:GemmaForCausalLM",
    "gemma3_text": "services.decoder.model_gemma:GemmaForCausalLM",
    "phi3": "services.decoder.model_phi3:Phi3ForCausalLM",
}


def model_sliding_window(model: torch.nn.Module) -> int | None:
    """The sliding window that bounds every attention layer of `model` (the largest of their
    `LlamaAttention.sliding_window`s), or None when a layer attends fully or none is a LlamaAttention:
    the scheduler releases a request's blocks before this window only (scheduler.py). On the
    transformers path, the window its layers were probed with (TransformersSpec.sliding_window)."""
    # a model of the transformers path exists only once its module is imported; the native path never
    # imports it (transformers' modeling code: ~40 MB of the decoder process's resident set)
    transformers_path = sys.modules.get("services.decoder.model_transformers")
    if transformers_path is not None and isinstance(model, transformers_path.TransformersForCausalLM):
        return model.spec.sliding_window
    windows = {module.sliding_window for module in model.modules() if isinstance(module, LlamaAttention)}
    return max(windows) if windows and None not in windows else None


def family_class(model_type: str) -> type[LlamaForCausalLM]:
    """The native class serving `model_type`, imported now.

    Raises:
        ValueError: no native family serves `model_type` (naming it and the served ones).
    """
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; expected one of {tuple(DECODER_ARCHITECTURES)}")
    module, name = MODEL_FAMILIES[model_type].split(":")
    return getattr(importlib.import_module(module), name)


def load_model(checkpoint: CheckpointConfig | str | Path, dtype: torch.dtype,
               mrope_section: tuple[int, int, int] | None = None, model_impl: str = "auto",
               quant_mode: str = "exact") -> LlamaForCausalLM:
    """The causal LM of a checkpoint (a family of `MODEL_FAMILIES`, or Qwen2-VL's language model), or
    transformers' own class on the paged KV cache (model_transformers.py) where `decoder_impl`
    says so for `model_impl` ("auto": native where a family exists).

    `checkpoint`: its config.json as read once by `DecoderConfig` (or a directory, read here).
    `quant_mode`: how matrices kept as GGUF blocks multiply ("exact" or "fast", quant.QUANT_MODES).

    Raises:
        ValueError: no config.json, an unsupported model_type or configuration, weights that do not match.
    """
    if not isinstance(checkpoint, CheckpointConfig):
        checkpoint = CheckpointConfig.read(checkpoint)
    try:
        impl = decoder_impl(checkpoint, model_impl)
    except ValueError as error:
        raise ValueError(f"{checkpoint.model_dir} {error}") from None
    if impl == "transformers":
        if quantized_types(checkpoint.model_dir):
            raise ValueError(f"{checkpoint.model_dir} holds GGUF-quantized matrices, which only tessera's native "
                             "model files serve; import the GGUF without --keep-quantized for transformers' path")
        if mrope_section is not None:
            raise ValueError(f"mrope_section {mrope_section}: transformers' path serves text only")
        from services.decoder.model_transformers import load_transformers_model

        return load_transformers_model(checkpoint, dtype)
    if is_qwen2_vl(checkpoint.raw):
        return load_qwen2_vl(checkpoint, dtype, mrope_section)
    return load_checkpoint(family_class(checkpoint.model_type), checkpoint, dtype, mrope_section, quant_mode)
