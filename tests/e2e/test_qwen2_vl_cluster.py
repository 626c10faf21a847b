"""A Qwen2-VL checkpoint through the whole cluster: `tessera up` wires the checkpoint's own vision
tower (vision service) and text model (decoder); answers equal transformers' generate with the image."""

from __future__ import annotations

import io
import uuid

import grpc
import numpy as np
import pytest
from PIL import Image
from transformers import AutoTokenizer

from services.common.server import CHANNEL_OPTIONS
from tessera.cli.up.launch import Cluster
from tessera.cli.up.spec import ClusterSpec
from tessera.v1 import decoder_pb2, gateway_pb2, gateway_pb2_grpc, vision_pb2
from tests.vision.qwen2_vl_tiny import MROPE_SECTION, build_tiny_qwen2_vl, hf_greedy, hf_inputs, reference_processor

from .conftest import _free_base_port
from .test_generate import collect

MAX_TOKENS = 16


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    yield from serve_tiny_vl(tmp_path_factory, build_tiny_qwen2_vl, "qwen2-vl-cluster")


def serve_tiny_vl(tmp_path_factory, build, name: str):
    """Build a tiny vision-language checkpoint with `build(directory)` and run the whole cluster on it;
    yields (transformers' model, its tokenizer, a gateway stub) until the fixture ends."""
    directory = tmp_path_factory.mktemp(name)
    model = build(directory)
    spec = ClusterSpec(base_port=_free_base_port(), decoder_model_dir=directory,
                       adapter_root=tmp_path_factory.mktemp("adapters"), log_dir=tmp_path_factory.mktemp("logs"),
                       extra_args={"adapters": ["--db", str(tmp_path_factory.mktemp("registry") / "catalog.sqlite3")]})
    assert spec.native_vision
    with Cluster(spec) as cluster, \
            grpc.insecure_channel(cluster.spec.address("gateway"), options=CHANNEL_OPTIONS) as channel:
        yield model, AutoTokenizer.from_pretrained(directory), gateway_pb2_grpc.GatewayStub(channel)


def test_image_answer_equals_transformers(qwen2_vl):
    model, tokenizer, gateway = qwen2_vl
    info = gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30)
    assert info.vision.encoder == "qwen2-vl" and list(info.decoder.mrope_section) == MROPE_SECTION
    for content in ([_png(64, 48, 1), "What is this?"], [_png(40, 90, 2), "Left", _png(90, 40, 3), "Right"]):
        parts = [decoder_pb2.ContentPart(image=vision_pb2.ImageInput(data=c)) if isinstance(c, bytes)
                 else decoder_pb2.ContentPart(text=c) for c in content]
        request = decoder_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex, messages=[decoder_pb2.ChatMessage(role="user", content=parts)],
            sampling=decoder_pb2.SamplingParams(max_tokens=MAX_TOKENS))
        batch = hf_inputs(tokenizer, reference_processor(), content)
        expected, _ = hf_greedy(model, batch, MAX_TOKENS)
        result = collect(gateway, request)
        assert result["ids"] == expected
        assert result["usage"].prompt_tokens == batch["input_ids"].shape[1]
        assert result["usage"].image_tokens == int((batch["input_ids"] == model.config.image_token_id).sum())
