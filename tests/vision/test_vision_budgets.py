"""Request budgets from the image headers: nothing is decoded or encoded for a request over them.

The images here claim their size in a PNG header over a few bytes of pixel data: decoding one
fails ("could not be decoded"), so a refusal that names the budget instead proves that the check
ran on the headers alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from qwen2_vl_tiny import build_tiny_qwen2_vl
from vision_images import encode, png_header_claiming, solid

from services.common.errors import InvalidArgument
from services.vision.config import VisionConfig
from services.vision.core import VisionCore
from services.vision.encoder import DemoEncoderConfig
from services.vision.processor import ImageSource, ProcessorConfig
from services.vision.qwen2_vl_encoder import Qwen2VLEncoderConfig
from services.vision.types import PromptBudget

WIDTH = 32
DEMO_TOKENS = (64 // 8) ** 2  # demo encoder: image_size 64, patch 8


def _demo(**processor) -> VisionCore:
    return VisionCore(VisionConfig(encoder=DemoEncoderConfig(output_width=WIDTH),
                                     processor=ProcessorConfig(**processor)))


def test_token_budget_is_checked_from_headers_before_decoding():
    engine = _demo()
    sources = [ImageSource(data=png_header_claiming(40 + i, 30)) for i in range(8)]
    with pytest.raises(InvalidArgument) as error:
        engine.process(sources, max_image_tokens=8 * DEMO_TOKENS - 1)
    assert f"8 images expand to {8 * DEMO_TOKENS} tokens" in str(error.value)
    assert f"the budget is {8 * DEMO_TOKENS - 1} (max_image_tokens" in str(error.value)
    assert engine.images_encoded == 0
    with pytest.raises(InvalidArgument, match="could not be decoded"):  # within budget: decoding is reached
        engine.process(sources, max_image_tokens=8 * DEMO_TOKENS)


def test_the_prompts_context_is_checked_from_headers_before_decoding_or_counting_the_cache():
    """7 images within the image budget whose prompt's text overflows the context with them: refused
    in the decoder's words, nothing decoded or encoded, no cache lookup counted."""
    engine = _demo()
    sources = [ImageSource(data=png_header_claiming(40 + i, 30)) for i in range(7)]
    text = 512 - 7 * DEMO_TOKENS - 16 + 1  # one token too many with max_tokens 16
    with pytest.raises(InvalidArgument) as error:
        engine.process(sources, max_image_tokens=512 - 16, prompt=PromptBudget(text, 16, 512))
    assert str(error.value) == (f"prompt has {text + 7 * DEMO_TOKENS} tokens after image expansion ({text} of text "
                                f"and template, {7 * DEMO_TOKENS} for 7 images of grids {', '.join(['1x8x8'] * 7)}) "
                                "and max_tokens 16; the model's context is 512")
    with pytest.raises(InvalidArgument, match="; the model's context is 512, which leaves no room to generate a token"):
        engine.process(sources, prompt=PromptBudget(512 - 7 * DEMO_TOKENS, 0, 512))
    stats = engine.cache.stats()
    assert (engine.images_encoded, stats.hits, stats.misses) == (0, 0, 0)
    with pytest.raises(InvalidArgument, match="could not be decoded"):  # fits: admitted, decoding is reached
        engine.process(sources, prompt=PromptBudget(text - 1, 16, 512))
    assert engine.cache.stats().misses == 7


def test_cached_images_count_their_grid_against_the_budget():
    engine = _demo()
    red = solid((255, 0, 0))
    engine.encode(engine.process([ImageSource(data=red)]))
    with pytest.raises(InvalidArgument, match=f"2 images expand to {2 * DEMO_TOKENS} tokens"):
        engine.process([ImageSource(data=red), ImageSource(data=red)], max_image_tokens=DEMO_TOKENS)
    assert len(engine.process([ImageSource(data=red)], max_image_tokens=DEMO_TOKENS)) == 1


def test_request_pixel_budget_is_checked_from_headers():
    engine = _demo(max_image_pixels=10_000, max_request_pixels=25_000)
    sources = [ImageSource(data=png_header_claiming(100, 100)) for _ in range(3)]
    with pytest.raises(InvalidArgument) as error:
        engine.process(sources)
    assert "images hold 30000 pixels together (100x100, 100x100, 100x100)" in str(error.value)
    assert "the limit is 25000 per request (--max-request-pixels)" in str(error.value)


def test_request_pixel_budget_must_hold_one_image():
    with pytest.raises(ValueError, match="max_request_pixels"):
        ProcessorConfig(max_image_pixels=1000, max_request_pixels=999)


@pytest.fixture(scope="module")
def qwen_engine(tmp_path_factory) -> VisionCore:
    directory = tmp_path_factory.mktemp("qwen2-vl-tiny-budget")
    build_tiny_qwen2_vl(directory)
    return VisionCore(VisionConfig.for_qwen2_vl(Qwen2VLEncoderConfig(model_dir=str(directory))))


@pytest.mark.parametrize("size", [(64, 64), (60, 150), (150, 60), (97, 53), (400, 300), (20, 30)])
def test_qwen2_vl_grid_from_the_header_equals_the_encoders(qwen_engine, size):
    width, height = size
    rng = np.random.default_rng(width * 1000 + height)
    data = encode(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)))
    expected = qwen_engine.grid_for(width, height)
    (image,) = qwen_engine.encode(qwen_engine.process([ImageSource(data=data)]))
    assert tuple(image.grid_thw) == expected
    with pytest.raises(InvalidArgument, match=f"expand to {image.rows.shape[0]} tokens"):
        qwen_engine.process([ImageSource(data=png_header_claiming(width, height))],
                            max_image_tokens=image.rows.shape[0] - 1)
