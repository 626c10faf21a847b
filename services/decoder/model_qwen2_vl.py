"""Qwen2-VL's language model: Qwen2 blocks with M-RoPE, loaded from a Qwen2-VL or Qwen2.5-VL HF checkpoint.

The text model is exactly transformers' Qwen2 (q/k/v bias, no o bias, SiLU MLP, RMSNorm) with
multimodal rotary embedding, so it reuses `Qwen2ForCausalLM` (model_qwen2.py); only the
config and the weight names differ. Qwen2.5-VL's language model is the same (transformers 5.24's
`Qwen2_5_VLTextModel` is `Qwen2VLTextModel`, its `get_rope_index` gives images the same positions;
only videos, which tessera does not take, are spaced by `tokens_per_second`), as are its config
and weight layouts; its vision tower differs and lives in the vision service
(services/vision/qwen2_5_vl_tower.py). Two checkpoint layouts are accepted:

    original (Qwen/Qwen2-VL-2B-Instruct, and transformers 5.24's save_pretrained):
        flat config.json, rope_scaling {"type": "mrope", "mrope_section": [16, 24, 24]};
        text weights "model.layers.*", "model.embed_tokens.*", "model.norm.*", "lm_head.*";
        vision weights "visual.*"
    transformers 5.x in-memory naming (Qwen2VLForConditionalGeneration.state_dict()):
        nested "text_config" with rope_parameters {"rope_type": "default", "mrope_section": [...]};
        text weights "model.language_model.*", vision weights "model.visual.*"

Vision weights are skipped (the vision service owns them). M-RoPE sections come from the
checkpoint; "mrope" / "default" rope types are plain RoPE frequencies, any other (scaled RoPE:
"linear", "dynamic", "yarn", ...) is refused. Image/vision-start/vision-end token ids come from
config.json (`image_token_id`, `vision_start_token_id`, `vision_end_token_id`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from services.common.checkpoint import CheckpointConfig
from services.common.mrope import QWEN_VL_MODEL_TYPES, check_checkpoint_section, check_mrope_section
from services.decoder.model_llama import LlamaForCausalLM, LlamaSpec, _read_safetensors, build_model
from services.decoder.model_qwen2 import Qwen2ForCausalLM

MODEL_TYPES = QWEN_VL_MODEL_TYPES
PLAIN_ROPE_TYPES = ("default", "mrope")
VISION_PREFIXES = ("visual.", "model.visual.")
TEXT_PREFIX = "model.language_model."


def is_qwen2_vl(cfg: dict) -> bool:
    return cfg.get("model_type") in MODEL_TYPES


def text_config(cfg: dict) -> dict:
    """The language model's flat HF config (nested `text_config` merged over the top level).

    `tie_word_embeddings` is read from the top level first: transformers ties the conditional
    generation model's lm_head by the outer config.
    """
    if not is_qwen2_vl(cfg):
        return cfg
    outer = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    inner = cfg.get("text_config") or {}
    flat = {**outer, **inner}
    flat["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", inner.get("tie_word_embeddings", False)))
    return flat


def _rope(flat: dict) -> dict:
    """The text model's RoPE settings as transformers 5 reads them: a legacy `rope_scaling` replaces
    `rope_parameters` when both are present (`services.common.checkpoint.rope_settings`)."""
    return flat.get("rope_scaling") or flat.get("rope_parameters") or {}


def mrope_section(cfg: dict) -> tuple[int, int, int]:
    """The checkpoint's M-RoPE sections (rotary pairs per t/h/w axis).

    Raises:
        ValueError: no mrope_section, a scaled rope type, or sections not summing to head_dim / 2.
    """
    flat = text_config(cfg)
    rope = _rope(flat)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in PLAIN_ROPE_TYPES:
        raise ValueError(f"scaled RoPE {rope_type!r} is not supported for Qwen2-VL; expected one of {PLAIN_ROPE_TYPES}")
    section = rope.get("mrope_section")
    if section is None:
        raise ValueError("config.json has no mrope_section")
    return check_mrope_section(section, flat.get("head_dim") or flat["hidden_size"] // flat["num_attention_heads"])


@dataclass(frozen=True)
class VisionTokens:
    """Placeholder token ids of a Qwen2-VL checkpoint (`<|image_pad|>`, `<|vision_start|>`, `<|vision_end|>`)."""

    image: int
    start: int | None
    end: int | None

    @classmethod
    def from_config(cls, cfg: dict) -> VisionTokens:
        """Raises ValueError when config.json has no image_token_id."""
        if cfg.get("image_token_id") is None:
            raise ValueError("Qwen2-VL config.json has no image_token_id")
        start, end = cfg.get("vision_start_token_id"), cfg.get("vision_end_token_id")
        return cls(int(cfg["image_token_id"]), None if start is None else int(start),
                   None if end is None else int(end))


def qwen2_spec(cfg: dict) -> LlamaSpec:
    """LlamaSpec of the text model (as a qwen2 model with plain RoPE frequencies)."""
    flat = dict(text_config(cfg))
    mrope_section(cfg)  # refuses scaled RoPE / bad sections
    theta = float(_rope(flat).get("rope_theta", flat.get("rope_theta", 10000.0)))
    flat.pop("rope_scaling", None)
    flat["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    flat["model_type"] = "qwen2"
    flat.pop("layer_types", None)  # Qwen2-VL lists "full_attention" only unless use_sliding_window
    architecture = (cfg.get("architectures") or ["Qwen2VLForConditionalGeneration"])[0]
    return replace(Qwen2ForCausalLM.spec_from_config(flat), architecture=architecture)


def _text_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop vision weights; rename "model.language_model.*" to "model.*"."""
    out = {}
    for name, tensor in state.items():
        if name.startswith(VISION_PREFIXES):
            continue
        if name.startswith(TEXT_PREFIX):
            name = "model." + name[len(TEXT_PREFIX):]
        out[name] = tensor
    return out


def load_qwen2_vl(checkpoint: CheckpointConfig | str | Path, dtype: torch.dtype,
                  section: tuple[int, int, int] | None = None) -> LlamaForCausalLM:
    """The Qwen2-VL language model with the checkpoint's M-RoPE sections.

    Args:
        section: sections the caller configured; must equal the checkpoint's (None = take them).
    Raises:
        ValueError: scaled RoPE, mismatched sections, missing/unexpected text weights.
    """
    if not isinstance(checkpoint, CheckpointConfig):
        checkpoint = CheckpointConfig.read(checkpoint)
    model_dir, cfg = checkpoint.model_dir, dict(checkpoint.raw)
    own = check_checkpoint_section(section, mrope_section(cfg))
    return build_model(Qwen2ForCausalLM, qwen2_spec(cfg), own, _text_weights(_read_safetensors(model_dir)), dtype,
                       f"text weights in {model_dir} do not match Qwen2-VL")
