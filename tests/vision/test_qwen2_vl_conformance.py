"""Qwen2-VL encoder conformance with transformers 5.24, on a tiny seeded checkpoint saved to disk.

References, run in process: `Qwen2VLImageProcessorPil` (the slow/PIL image processor; the fast
one needs torchvision, which is not installed) and `Qwen2VLForConditionalGeneration.model.visual`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from qwen2_vl_tiny import (
    MAX_PIXELS,
    MIN_PIXELS,
    MROPE_SECTION,
    build_tiny_qwen2_vl,
    noise_png,
    visual_reference,
)
from vision_images import encode, png_header_claiming

from services.common.errors import InvalidArgument
from services.vision.__main__ import parse_args
from services.vision.config import VisionConfig
from services.vision.core import VisionCore
from services.vision.processor import ImageProcessor, ImageSource, ProcessorConfig
from services.vision.qwen2_vl_encoder import Qwen2VLEncoderConfig
from services.vision.qwen2_vl_pixels import patchify

# (width, height): square, tall, wide, odd-sized, above max_pixels (downscaled), below min_pixels (upscaled)
SIZES = [(64, 64), (60, 150), (150, 60), (97, 53), (400, 300), (20, 30)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-vl-tiny")
    model = build_tiny_qwen2_vl(directory)
    engine = VisionCore(VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(directory))))
    return directory, model, engine


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_pixel_values_grid_and_rows_equal_transformers(tiny, size):
    _, model, engine = tiny
    data = noise_png(*size)
    want_pixels, want_grid, want_rows = visual_reference(model, [data])
    (prepared,) = engine.process([ImageSource(data=data)])
    pixel_values, grid = patchify(prepared.processed.pixels, engine.config.processor.qwen2_vl)
    assert torch.equal(pixel_values, want_pixels)  # bit-identical: same resize, rescale, normalize, row order
    assert grid == tuple(want_grid[0].tolist())
    (image,) = engine.encode([prepared])
    assert image.rows.shape == want_rows.shape and image.rows.dtype == torch.float32
    assert torch.allclose(image.rows, want_rows, atol=1e-5, rtol=0)
    assert image.grid_thw == (1, grid[1] // 2, grid[2] // 2)  # LLM units: after the 2x2 merge
    assert image.mrope_section == tuple(MROPE_SECTION)
    height, width = grid[1] * 14, grid[2] * 14
    assert MIN_PIXELS <= height * width <= MAX_PIXELS and height % 28 == 0 == width % 28


def test_several_images_in_one_batch_attend_only_within_themselves(tiny):
    _, model, engine = tiny
    images = [noise_png(97, 53), noise_png(60, 150), noise_png(64, 64, seed=3)]
    _, grids, want_rows = visual_reference(model, images)
    encoded = engine.encode(engine.process([ImageSource(data=d) for d in images]))
    counts = [int(g.prod()) // 4 for g in grids]
    for image, want in zip(encoded, torch.split(want_rows, counts), strict=True):
        assert torch.allclose(image.rows, want, atol=1e-5, rtol=0)
    alone = engine.encoder.encode([engine.processor.process(ImageSource(data=images[1])).pixels])[0]
    assert torch.allclose(alone.rows, encoded[1].rows, atol=1e-5, rtol=0)


def test_transposed_pixels_never_collide(tiny):
    _, _, engine = tiny
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (56, 112, 3), dtype=np.uint8))
    wide, tall = encode(image), encode(image.transpose(Image.Transpose.TRANSPOSE))
    a, b = engine.encode(engine.process([ImageSource(data=wide), ImageSource(data=tall)]))
    assert a.content_hash != b.content_hash
    assert (a.grid_thw, b.grid_thw) == ((1, 2, 4), (1, 4, 2))
    assert not torch.allclose(a.rows, b.rows, atol=1e-3)


def test_refusals_before_decoding(tiny):
    _, _, engine = tiny
    cases = {
        "aspect ratio 202.0; the limit is 200": encode(Image.new("RGB", (2828, 14))),
        "at least one patch (14 pixels)": encode(Image.new("RGB", (13, 40))),
        # only a header: refused on its claimed size, not later as undecodable
        "aspect ratio 500.0": png_header_claiming(50, 25000),
    }
    for reason, data in cases.items():
        with pytest.raises(InvalidArgument, match=reason.replace("(", r"\(").replace(")", r"\)")):
            engine.process([ImageSource(data=data)])
    (ok,) = engine.encode(engine.process([ImageSource(data=encode(Image.new("RGB", (2800, 14))))]))  # ratio 200
    assert ok.grid_thw[1] == 1  # one merged row tall


def test_min_max_pixel_overrides_change_grid_and_hash(tiny):
    directory, _, engine = tiny
    data = noise_png(400, 300)
    small = VisionCore(VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(directory),
                                                                        max_pixels=28 * 28 * 16)))
    (a,), (b,) = (e.encode(e.process([ImageSource(data=data)])) for e in (engine, small))
    assert a.grid_thw[1] * a.grid_thw[2] > 16 >= b.grid_thw[1] * b.grid_thw[2]
    assert a.content_hash != b.content_hash  # the recipe is part of the key


def test_config_checks_and_cli(tiny):
    directory, _, _ = tiny
    config = parse_args(["--encoder", "qwen2-vl", "--model-dir", str(directory), "--max-pixels", "20000"])
    assert config.mrope_section == tuple(MROPE_SECTION) and config.processor.qwen2_vl.max_pixels == 20000
    assert config.decoder.hidden_size == 64 and config.decoder.head_dim == 16
    for argv in (["--mrope-section", "8,12,12"], ["--output-width", "64"]):
        with pytest.raises(SystemExit):
            parse_args(["--encoder", "qwen2-vl", "--model-dir", str(directory), *argv])
    with pytest.raises(ValueError, match="checkpoint's recipe"):  # a demo recipe cannot feed the Qwen2-VL tower
        VisionConfig(encoder=Qwen2VLEncoderConfig(model_dir=str(directory)), processor=ProcessorConfig(),
                     mrope_section=tuple(MROPE_SECTION))
    with pytest.raises(ValueError, match="no config.json"):
        Qwen2VLEncoderConfig(model_dir=str(directory / "missing"))
    assert ImageProcessor(config.processor).process(ImageSource(data=noise_png(97, 53))).pixels.shape[0] == 3


def test_original_release_layout_loads_the_same_tower(tiny, tmp_path):
    """Qwen2-VL-2B's own files: flat text config, rope_scaling {type: mrope}, in_chans/spatial_patch_size,
    min/max_pixels in preprocessor_config.json; weight names with a `model.visual.` prefix load too."""
    import json

    from safetensors.torch import load_file, save_file

    directory, _, engine = tiny
    config = json.loads((directory / "config.json").read_text())
    vision = config.pop("vision_config")
    vision["in_chans"], vision["spatial_patch_size"] = vision.pop("in_channels"), vision.pop("patch_size")
    del vision["hidden_act"], vision["rope_parameters"]  # the release relies on defaults (quick_gelu, 10000)
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**config, **text, "vision_config": vision, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    pixels = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pixels))
    weights = load_file(directory / "model.safetensors")
    save_file({("model." + k if k.startswith("visual.") else k): v for k, v in weights.items()},
              tmp_path / "model.safetensors")
    release = VisionCore(VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(tmp_path))))
    assert release.encoder.revision == engine.encoder.revision and release.config.mrope_section == tuple(MROPE_SECTION)
    data = noise_png(97, 53)
    (a,), (b,) = (e.encode(e.process([ImageSource(data=data)])) for e in (engine, release))
    assert torch.equal(a.rows, b.rows) and a.content_hash == b.content_hash
