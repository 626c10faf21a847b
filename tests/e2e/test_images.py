"""Images flow gateway -> vision -> decoder; a gateway without vision refuses them."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import grpc
import pytest
from PIL import Image

from services.common.auth import INTERNAL_TOKEN_FILE_ENV
from tessera.v1 import decoder_pb2, gateway_pb2, gateway_pb2_grpc, vision_pb2

from .conftest import VISION_MAX_BYTES
from .test_generate import chat_request, collect


def png_bytes(width: int, height: int, color=(200, 30, 60)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def image_request(data: bytes, text: str = "Describe the image.", max_tokens: int = 6):
    request = chat_request(text, max_tokens)
    request.messages[0].content.insert(0, decoder_pb2.ContentPart(image=vision_pb2.ImageInput(data=data)))
    return request


def test_image_request_counts_expanded_tokens(gateway):
    info = gateway.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=30)
    patches = (info.vision.image_size // info.vision.patch_size) ** 2
    assert patches > 1
    with_image = collect(gateway, image_request(png_bytes(40, 30)))
    text_only = collect(gateway, chat_request("Describe the image.", 6))
    assert with_image["finish"] in ("stop", "length")
    assert with_image["usage"].image_tokens == patches
    # One placeholder became `patches` prompt positions (text splits at the image, +-1 token).
    extra = with_image["usage"].prompt_tokens - text_only["usage"].prompt_tokens
    assert abs(extra - patches) <= 1, (extra, patches)


@pytest.mark.parametrize("data, needle", [
    (b"this is not an image", "decode"),
    (os.urandom(VISION_MAX_BYTES + 1), str(VISION_MAX_BYTES)),
])
def test_bad_images_are_invalid_argument(gateway, assert_healthy, data, needle):
    with pytest.raises(grpc.RpcError) as error:
        collect(gateway, image_request(data))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in error.value.details().lower() or needle in error.value.details()
    assert_healthy()


def test_gateway_without_vision_refuses_images(cluster):
    spec = cluster.spec
    port = spec.base_port + 5 + (os.getpid() % 50)
    address = f"127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "services.gateway", "--address", address,
                                "--decoder", spec.address("decoder"), "--pooling", spec.address("pooling"),
                                "--adapters", spec.address("adapters"), "--vision", ""],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, INTERNAL_TOKEN_FILE_ENV: str(cluster.token_file)})  # the cluster's secret
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = gateway_pb2_grpc.GatewayStub(channel)
            deadline = time.monotonic() + 30
            while True:
                try:
                    with pytest.raises(grpc.RpcError) as error:
                        collect(stub, image_request(png_bytes(16, 16)))
                    break
                except AssertionError:
                    if time.monotonic() > deadline:
                        raise
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "image" in error.value.details()
            assert collect(stub, chat_request("Hi", 2))["finish"]  # text still works there
    finally:
        process.terminate()
        process.wait(timeout=30)
