"""Demo encoder and engine: shapes, seeded determinism, revision, content hashes, config checks."""

from __future__ import annotations

import pytest
import torch
from vision_images import solid, two_halves

from services.common.errors import InvalidArgument
from services.vision.config import DecoderGeometry, VisionConfig
from services.vision.core import VisionCore
from services.vision.encoder import DemoEncoder, DemoEncoderConfig, decoder_geometry
from services.vision.processor import ImageSource, ProcessorConfig
from tessera.paths import default_decoder_dir

WIDTH = 64


def pixels(seed: int) -> torch.Tensor:
    return torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_output_shape_grid_and_dtype():
    encoder = DemoEncoder(DemoEncoderConfig(output_width=WIDTH))
    (out,) = encoder.encode([pixels(0)])
    assert out.rows.shape == (64, WIDTH) and out.rows.dtype == torch.float32
    assert out.grid_thw == (1, 8, 8) and torch.isfinite(out.rows).all()
    (small,) = DemoEncoder(DemoEncoderConfig(output_width=32, image_size=32, patch_size=16)).encode(
        [torch.zeros(3, 32, 32)])
    assert small.rows.shape == (4, 32) and small.grid_thw == (1, 2, 2)
    with pytest.raises(ValueError, match=r"\(3, 64, 64\)"):
        encoder.encode([torch.zeros(3, 32, 32)])


def test_same_seed_same_weights_and_revision_without_touching_global_rng():
    state = torch.get_rng_state()
    a, b = (DemoEncoder(DemoEncoderConfig(output_width=WIDTH, seed=0)) for _ in range(2))
    assert torch.equal(torch.get_rng_state(), state)
    assert a.revision == b.revision and len(a.revision) == 16
    assert torch.equal(a.encode([pixels(1)])[0].rows, b.encode([pixels(1)])[0].rows)
    other = DemoEncoder(DemoEncoderConfig(output_width=WIDTH, seed=1))
    assert other.revision != a.revision
    assert not torch.allclose(other.encode([pixels(1)])[0].rows, a.encode([pixels(1)])[0].rows)


def test_batch_rows_match_single_rows_and_differ_per_image():
    encoder = DemoEncoder(DemoEncoderConfig(output_width=WIDTH))
    batch = encoder.encode([pixels(1), pixels(2)])
    single = encoder.encode([pixels(2)])[0]
    assert torch.allclose(batch[1].rows, single.rows, atol=1e-5)
    assert not torch.allclose(batch[0].rows, batch[1].rows, atol=1e-3)


def _engine(**processor) -> VisionCore:
    return VisionCore(VisionConfig(encoder=DemoEncoderConfig(output_width=WIDTH),
                                     processor=ProcessorConfig(**processor)))


def test_engine_hashes_identify_the_image_config_and_revision():
    engine = _engine()
    red, blue = ImageSource(data=solid((255, 0, 0))), ImageSource(data=solid((0, 0, 255)))
    first = engine.encode(engine.process([red, blue, red]))
    assert [e.grid_thw for e in first] == [(1, 8, 8)] * 3 and first[0].mrope_section == (8, 12, 12)
    assert first[0].content_hash == first[2].content_hash != first[1].content_hash
    assert len(first[0].content_hash) == 64
    assert _engine().encode(_engine().process([red]))[0].content_hash == first[0].content_hash
    black = _engine(background=(0, 0, 0))  # the recipe enters the hash when the engine reads the bytes
    assert black.encode(black.process([red]))[0].content_hash != first[0].content_hash
    reseeded = VisionCore(VisionConfig(encoder=DemoEncoderConfig(output_width=WIDTH, seed=7)))
    assert reseeded.encode(reseeded.process([red]))[0].content_hash != first[0].content_hash
    # the same pixels transposed (W x H vs H x W) resize to different inputs and hash differently
    wide, tall = (ImageSource(data=two_halves((255, 0, 0), (0, 0, 255), size=s)) for s in [(40, 20), (20, 40)])
    a, b = engine.encode(engine.process([wide, tall]))
    assert a.content_hash != b.content_hash


def test_engine_reports_which_image_was_refused_and_the_count_cap():
    engine = _engine(max_images=2)
    with pytest.raises(InvalidArgument, match="image 1: image could not be decoded"):
        engine.process([ImageSource(data=solid((1, 2, 3))), ImageSource(data=b"junk")])
    with pytest.raises(InvalidArgument, match="3 images; at most 2"):
        engine.process([ImageSource(data=solid((1, 2, 3)))] * 3)
    info = engine.info()
    assert info.encoder == "demo" and info.output_width == WIDTH and info.max_images_per_request == 2


def test_decoder_geometry_from_the_prepared_checkpoint_and_config_checks():
    geometry = DecoderGeometry.from_model_dir(default_decoder_dir())
    assert (geometry.hidden_size, geometry.head_dim) == decoder_geometry(default_decoder_dir()) == (576, 64)
    VisionConfig(encoder=DemoEncoderConfig(output_width=576), decoder=geometry)
    with pytest.raises(ValueError, match="hidden_size 576"):
        VisionConfig(encoder=DemoEncoderConfig(output_width=64), decoder=geometry)
    with pytest.raises(ValueError, match="head_dim 64"):
        VisionConfig(encoder=DemoEncoderConfig(output_width=576), decoder=geometry, mrope_section=(8, 8, 8))
    with pytest.raises(ValueError, match="image_size"):
        VisionConfig(encoder=DemoEncoderConfig(output_width=64), processor=ProcessorConfig(image_size=32))
    with pytest.raises(ValueError, match="patch_size"):
        DemoEncoderConfig(output_width=64, image_size=64, patch_size=7)
