"""End to end over a real socket: `python -m services.vision` in a subprocess, a plain grpc client."""

from __future__ import annotations

import base64
import signal
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from vision_images import solid, two_halves

from services.common.launch import ServiceProcess
from services.common.server import CHANNEL_OPTIONS
from services.common.tensor import from_pb
from services.vision.config import VisionConfig
from services.vision.core import VisionCore
from services.vision.encoder import DemoEncoderConfig
from services.vision.processor import ImageSource, ProcessorConfig
from tessera.v1 import vision_pb2, vision_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
WIDTH = 64


@pytest.fixture(scope="module")
def server():
    args = ["--output-width", str(WIDTH), "--max-images", "2", "--max-image-bytes", "100000"]
    with ServiceProcess("services.vision", args) as service:
        channel = grpc.insecure_channel(service.address, options=CHANNEL_OPTIONS)
        yield channel, service.process
        channel.close()


def test_encode_info_health_and_errors(server):
    channel, process = server
    stub = vision_pb2_grpc.VisionStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="tessera.v1.Vision")).status == \
        health_pb2.HealthCheckResponse.SERVING

    reference = VisionCore(VisionConfig(encoder=DemoEncoderConfig(output_width=WIDTH),
                                          processor=ProcessorConfig(max_images=2, max_image_bytes=100000)))
    info = stub.GetInfo(vision_pb2.VisionInfoRequest(), timeout=10)
    assert info.encoder == "demo" and info.revision == reference.encoder.revision  # same seed, other process
    assert (info.output_width, info.image_size, info.patch_size, info.max_images_per_request) == (WIDTH, 64, 8, 2)
    assert list(info.mrope_section) == [8, 12, 12] and info.max_image_bytes == 100000

    png, jpeg = two_halves((255, 0, 0), (0, 0, 255)), solid((10, 200, 30), fmt="JPEG")
    uri = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    response = stub.EncodeImages(vision_pb2.EncodeImagesRequest(
        images=[vision_pb2.ImageInput(data=png), vision_pb2.ImageInput(data_uri=uri)]), timeout=30)
    expected = reference.encode(reference.process([ImageSource(data=png), ImageSource(data=jpeg)]))
    assert len(response.images) == 2
    for got, want in zip(response.images, expected, strict=True):
        rows = from_pb(got.rows)
        assert rows.shape == (64, WIDTH) and rows.dtype == torch.float32 and got.rows.dtype == "float32"
        assert torch.allclose(rows, want.rows, atol=1e-5)
        assert list(got.grid_thw) == [1, 8, 8] and list(got.mrope_section) == [8, 12, 12]
        assert got.content_hash == want.content_hash
    assert response.images[0].content_hash != response.images[1].content_hash

    bad_requests = {
        "could not be decoded": [vision_pb2.ImageInput(data=b"not an image")],
        "remote URLs are not fetched": [vision_pb2.ImageInput(data_uri="https://example.com/a.png")],
        "3 images; at most 2": [vision_pb2.ImageInput(data=png)] * 3,
        "the limit is 100000": [vision_pb2.ImageInput(data=b"\x00" * 100001)],
        "neither data nor data_uri": [vision_pb2.ImageInput()],
    }
    for reason, images in bad_requests.items():
        with pytest.raises(grpc.RpcError) as caught:
            stub.EncodeImages(vision_pb2.EncodeImagesRequest(images=images), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, reason
        assert reason in caught.value.details()

    again = stub.EncodeImages(vision_pb2.EncodeImagesRequest(images=[vision_pb2.ImageInput(data=png)]), timeout=30)
    assert again.images[0].content_hash == expected[0].content_hash  # still answering, same result
    assert torch.equal(from_pb(again.images[0].rows), from_pb(response.images[0].rows))
    info = stub.GetInfo(vision_pb2.VisionInfoRequest(), timeout=10)
    assert info.images_encoded == 2  # the repeated PNG came from the encoder cache
    assert (info.encoder_cache.hits, info.encoder_cache.entries) == (1, 2)
    assert info.encoder_cache.bytes == 2 * 64 * WIDTH * 4 <= info.encoder_cache.capacity_bytes

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0


def test_qwen2_vl_encoder_over_grpc(tmp_path):
    """`--encoder qwen2-vl --model-dir DIR` serves transformers' visual rows; refusals keep it healthy."""
    import io

    from PIL import Image
    from qwen2_vl_tiny import MROPE_SECTION, build_tiny_qwen2_vl, reference_processor
    from vision_images import encode

    model = build_tiny_qwen2_vl(tmp_path)
    with ServiceProcess("services.vision", ["--encoder", "qwen2-vl", "--model-dir", str(tmp_path)]) as service, \
            grpc.insecure_channel(service.address, options=CHANNEL_OPTIONS) as channel:
        stub = vision_pb2_grpc.VisionStub(channel)
        info = stub.GetInfo(vision_pb2.VisionInfoRequest(), timeout=10)
        assert (info.encoder, info.output_width, info.image_size, info.patch_size) == ("qwen2-vl", 64, 0, 14)
        assert list(info.mrope_section) == MROPE_SECTION and info.max_pixels == 28 * 28 * 64

        png = two_halves((255, 0, 0), (0, 0, 255), size=(97, 53))
        batch = reference_processor()(images=[Image.open(io.BytesIO(png))], return_tensors="pt")
        with torch.no_grad():
            want = model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
        uri = "data:image/png;base64," + base64.b64encode(png).decode()
        (got,) = stub.EncodeImages(vision_pb2.EncodeImagesRequest(images=[vision_pb2.ImageInput(data_uri=uri)]),
                                   timeout=30).images
        assert torch.allclose(from_pb(got.rows), want, atol=1e-5, rtol=0)
        assert list(got.grid_thw) == [1, 2, 3] and list(got.mrope_section) == MROPE_SECTION

        for reason, data in {"aspect ratio": encode(Image.new("RGB", (2828, 14))),
                             "at least one patch": encode(Image.new("RGB", (13, 40)))}.items():
            with pytest.raises(grpc.RpcError) as caught:
                stub.EncodeImages(vision_pb2.EncodeImagesRequest(images=[vision_pb2.ImageInput(data=data)]), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in caught.value.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub.EncodeImages(vision_pb2.EncodeImagesRequest(images=[vision_pb2.ImageInput(data=png)]), timeout=30)
        info = stub.GetInfo(vision_pb2.VisionInfoRequest(), timeout=10)
        assert (info.images_encoded, info.encoder_cache.hits) == (1, 1)  # the repeat skipped the encoder
