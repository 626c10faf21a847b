"""A tiny Qwen2.5-VL checkpoint with seeded random weights, built offline with transformers' config classes.

Tokenizer, chat template and image processor are the tiny Qwen2-VL's (qwen2_vl_tiny): transformers
maps qwen2_5_vl to the same `Qwen2VLImageProcessor`, and the placeholder ids are the same. The
vision tower has windows of 2 x 2 merged tokens (window_size 56 = 2 * patch 14 * merge 2) and full
attention in its last block, so a merged grid of 3 x 4 is cut into windows of 4, 4, 2 and 2 tokens.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from tests.vision.qwen2_vl_tiny import MROPE_SECTION, save_seeded

WINDOW_SIZE, FULLATT_BLOCK_INDEXES = 56, [1]


def tiny_config(text: dict | None = None, vision: dict | None = None) -> Qwen2_5_VLConfig:
    """Head size 16 (sections MROPE_SECTION) unless `text` overrides; `vision` overrides the tower."""
    text = {**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
                   rope_parameters={"rope_type": "default", "mrope_section": MROPE_SECTION, "rope_theta": 10000.0}),
            **(text or {})}
    vision = {**dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=text["hidden_size"],
                     window_size=WINDOW_SIZE, fullatt_block_indexes=FULLATT_BLOCK_INDEXES, spatial_merge_size=2),
              **(vision or {})}
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
                            vision_start_token_id=252, vision_end_token_id=253)


def build_tiny_qwen2_5_vl(directory: Path, seed: int = 0, text: dict | None = None,
                          vision: dict | None = None) -> Qwen2_5_VLForConditionalGeneration:
    """Save a seeded tiny Qwen2.5-VL (config.json, model.safetensors, preprocessor_config.json,
    tokenizer) to `directory`; `text` and `vision` override its text_config and vision_config."""
    return save_seeded(Qwen2_5_VLForConditionalGeneration, tiny_config(text, vision), directory, seed)
