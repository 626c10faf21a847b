"""A Qwen2.5-VL checkpoint through the whole cluster: `tessera up` wires the checkpoint's own vision
tower (window attention, in the vision service) and text model (decoder); answers equal transformers'
generate with the images, and the same image again hits the decoder's prefix cache."""

from __future__ import annotations

import uuid

import pytest

from tessera.v1 import decoder_pb2, gateway_pb2, vision_pb2
from tests.vision.qwen2_5_vl_tiny import build_tiny_qwen2_5_vl
from tests.vision.qwen2_vl_tiny import MROPE_SECTION, hf_greedy, hf_inputs, reference_processor

from .test_generate import collect
from .test_qwen2_vl_cluster import _png, serve_tiny_vl

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    yield from serve_tiny_vl(tmp_path_factory, build_tiny_qwen2_5_vl, "qwen2-5-vl-cluster")


def _generate(gateway, content):
    parts = [decoder_pb2.ContentPart(image=vision_pb2.ImageInput(data=c)) if isinstance(c, bytes)
             else decoder_pb2.ContentPart(text=c) for c in content]
    request = decoder_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex, messages=[decoder_pb2.ChatMessage(role="user", content=parts)],
        sampling=decoder_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    return collect(gateway, request)


def test_images_answer_as_transformers_and_the_same_image_hits_the_prefix_cache(qwen2_5_vl):
    model, tokenizer, gateway = qwen2_5_vl
    info = gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30)
    assert info.vision.encoder == "qwen2.5-vl" and list(info.decoder.mrope_section) == MROPE_SECTION
    wide = [_png(150, 60, 1), "What is this?"]  # merged grid 2 x 5: windows of 4, 4 and 2 tokens
    two = [_png(40, 90, 2), "Left", _png(97, 53, 3), "Right"]  # 3 x 2 and 2 x 3
    image_ends = {}
    for name, content in (("wide", wide), ("two", two), ("wide again", wide)):
        batch = hf_inputs(tokenizer, reference_processor(), content)
        expected, _ = hf_greedy(model, batch, MAX_TOKENS)
        result = _generate(gateway, content)
        assert result["ids"] == expected, name
        image = (batch["input_ids"][0] == model.config.image_token_id).nonzero()
        image_ends[name] = (int(image[0]), int(image[-1]) + 1)
        assert result["usage"].prompt_tokens == batch["input_ids"].shape[1]
        assert result["usage"].image_tokens == len(image)
        if name == "wide again":
            assert result["usage"].cached_prompt_tokens >= image_ends[name][1]  # the image's KV is reused
    other = _generate(gateway, [_png(150, 60, 4), "What is this?"])  # same size and placeholders, other pixels
    assert other["usage"].cached_prompt_tokens <= image_ends["wide"][0]
