"""Qwen2.5-VL encoder conformance with transformers 5.24, on a tiny seeded checkpoint saved to disk.

References, run in process: `Qwen2VLImageProcessorPil` (the processor transformers maps qwen2_5_vl
to), `Qwen2_5_VLForConditionalGeneration.model.visual` and transformers' `get_vision_window_index`.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from qwen2_5_vl_tiny import WINDOW_SIZE, build_tiny_qwen2_5_vl
from qwen2_vl_tiny import MROPE_SECTION, noise_png, visual_reference
from transformers.vision_utils import get_vision_window_index

from services.vision.__main__ import parse_args
from services.vision.config import VisionConfig
from services.vision.core import VisionCore
from services.vision.processor import ImageSource
from services.vision.qwen2_5_vl_tower import Qwen2_5_VLVisionTower, window_index
from services.vision.qwen2_vl_encoder import Qwen2VLEncoderConfig, read_checkpoint
from services.vision.qwen2_vl_pixels import patchify

# (width, height) -> merged grid: one whole window (2 x 2), the last window cut short (2 x 3, 2 x 5),
# a downscaled one of 3 x 5 windows (6 x 9)
SIZES = [(64, 64), (97, 53), (150, 60), (400, 300)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-5-vl-tiny")
    model = build_tiny_qwen2_5_vl(directory)
    engine = VisionCore(VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(directory))))
    return directory, model, engine


@pytest.mark.parametrize("window_size", [56, 112])
def test_window_index_equals_transformers(window_size):
    """Grids in patches: a multiple of the window, cut short on both sides, two frames, several images."""
    for grids in ([(1, 8, 8)], [(1, 6, 10)], [(2, 4, 6)], [(1, 2, 14), (1, 10, 6), (1, 4, 4)]):
        index, cu_seqlens = window_index(grids, merge=2, window=window_size // 28)
        want_index, want_cu = get_vision_window_index(torch.tensor(grids), 2, window_size, 14)
        assert torch.equal(index, want_index), grids
        assert cu_seqlens == want_cu.tolist(), grids


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_pixel_values_grid_and_rows_equal_transformers(tiny, size):
    _, model, engine = tiny
    data = noise_png(*size)
    want_pixels, want_grid, want_rows = visual_reference(model, [data])
    (prepared,) = engine.process([ImageSource(data=data)])
    pixel_values, grid = patchify(prepared.processed.pixels, engine.config.processor.qwen2_vl)
    assert torch.equal(pixel_values, want_pixels)  # the Qwen2-VL recipe, bit for bit
    assert grid == tuple(want_grid[0].tolist())
    (image,) = engine.encode([prepared])
    assert image.rows.shape == want_rows.shape == (grid[1] * grid[2] // 4, 64)
    assert torch.allclose(image.rows, want_rows, atol=1e-5, rtol=0)
    assert image.grid_thw == (1, grid[1] // 2, grid[2] // 2) and image.mrope_section == tuple(MROPE_SECTION)


def test_several_images_in_one_batch_attend_only_within_themselves(tiny):
    _, model, engine = tiny
    images = [noise_png(97, 53), noise_png(400, 300), noise_png(60, 150, seed=3)]
    _, grids, want_rows = visual_reference(model, images)
    encoded = engine.encode(engine.process([ImageSource(data=d) for d in images]))
    for image, want in zip(encoded, torch.split(want_rows, [int(g.prod()) // 4 for g in grids]), strict=True):
        assert torch.allclose(image.rows, want, atol=1e-5, rtol=0)
    alone = engine.encoder.encode([engine.processor.process(ImageSource(data=images[1])).pixels])[0]
    assert torch.allclose(alone.rows, encoded[1].rows, atol=1e-5, rtol=0)


def test_window_attention_decides_the_rows(tiny):
    """The same weights with full attention in every block: equal rows for an image that is one
    window, different rows for one of several windows (so the conformance above tests the windows)."""
    _, _, engine = tiny
    tower = engine.encoder.model
    config = tower.config
    full = Qwen2_5_VLVisionTower(replace(config, fullatt_block_indexes=(0, 1))).eval()
    full.load_state_dict(tower.state_dict())
    for size, same in (((64, 64), True), ((400, 300), False)):
        pixels = engine.processor.process(ImageSource(data=noise_png(*size))).pixels
        values, grid = patchify(pixels, engine.config.processor.qwen2_vl)
        with torch.no_grad():
            assert torch.allclose(tower(values, [grid]), full(values, [grid]), atol=1e-5) == same, size


def test_encoder_name_config_and_cli(tiny, tmp_path):
    directory, _, engine = tiny
    assert engine.encoder.name == "qwen2.5-vl" and engine.info().encoder == "qwen2.5-vl"
    assert engine.encoder.output_width == 64  # out_hidden_size, the LLM's width (hidden_size is the ViT's 32)
    vision = read_checkpoint(Qwen2VLEncoderConfig(model_dir=str(directory))).vision
    assert (vision.window_size, vision.fullatt_block_indexes, vision.merged_window) == (WINDOW_SIZE, (1,), 2)
    config = parse_args(["--encoder", "qwen2-vl", "--model-dir", str(directory)])
    assert config.mrope_section == tuple(MROPE_SECTION) and config.decoder.hidden_size == 64
    raw = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "vision_config": {**raw["vision_config"],
                                                                                "window_size": 20}}))
    with pytest.raises(ValueError, match=r"window_size 20 is below one merged patch \(28 pixels\)"):
        read_checkpoint(Qwen2VLEncoderConfig(model_dir=str(tmp_path)))


def test_original_release_layout_loads_the_same_tower(tiny, tmp_path):
    """Qwen2.5-VL-3B's own files: a flat text config with rope_scaling {type: mrope}, in_chans and
    spatial_patch_size, tokens_per_second, no vision rope_parameters; `model.visual.` names load too."""
    from safetensors.torch import load_file, save_file

    directory, _, engine = tiny
    config = json.loads((directory / "config.json").read_text())
    vision = config.pop("vision_config")
    vision["in_chans"], vision["spatial_patch_size"] = vision.pop("in_channels"), vision.pop("patch_size")
    del vision["rope_parameters"]
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**config, **text, "model_type": "qwen2_5_vl", "vision_config": vision, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    (tmp_path / "preprocessor_config.json").write_text((directory / "preprocessor_config.json").read_text())
    weights = load_file(directory / "model.safetensors")
    save_file({("model." + k if k.startswith("visual.") else k): v for k, v in weights.items()},
              tmp_path / "model.safetensors")
    release = VisionCore(VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(tmp_path))))
    assert release.encoder.revision == engine.encoder.revision and release.encoder.name == "qwen2.5-vl"
    data = noise_png(97, 53)
    (a,), (b,) = (e.encode(e.process([ImageSource(data=data)])) for e in (engine, release))
    assert torch.equal(a.rows, b.rows) and a.content_hash == b.content_hash
