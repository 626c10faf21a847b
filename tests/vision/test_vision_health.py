"""The vision encoder path under faults: an encoder error fails only its request; a fatal one (or
an encode that never ends) turns health NOT_SERVING, and a stopped encoder fails requests at once
with UNAVAILABLE. Faults are injected by making the running engine's encoder raise or block."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from vision_images import solid

from services.vision.config import VisionConfig
from services.vision.encoder import DemoEncoderConfig
from services.vision.engine import VisionEngine
from services.vision.servicer import VisionServicer
from tessera.v1 import vision_pb2, vision_pb2_grpc
from tests.common.serving import NOT_SERVING, SERVING, WatchedHealth, serving


class EncoderKilled(BaseException):
    """Not an Exception: the encoder cannot be trusted after it."""


def _register(servicer):
    def register(server):
        vision_pb2_grpc.add_VisionServicer_to_server(servicer, server)
        return [vision_pb2.DESCRIPTOR.services_by_name["Vision"].full_name]

    return register


def _images(*colors) -> vision_pb2.EncodeImagesRequest:
    return vision_pb2.EncodeImagesRequest(images=[vision_pb2.ImageInput(data=solid(c)) for c in colors])


def test_a_dead_encoder_says_not_serving_and_fails_requests_at_once():
    engine = VisionEngine(VisionConfig(encoder=DemoEncoderConfig(output_width=64), encoder_cache_bytes=0))
    calls = {"n": 0}

    def faulty(pixels):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected encoder error")
        raise EncoderKilled("injected: the encoder went down")

    async def main():
        async with serving("vision", _register(VisionServicer(engine)), engine.health, start=engine.start) as channel:
            stub = vision_pb2_grpc.VisionStub(channel)
            watch = WatchedHealth(channel, "tessera.v1.Vision")
            await watch.wait_for(SERVING, 5)
            assert len((await stub.EncodeImages(_images((1, 2, 3)))).images) == 1

            engine.core.encoder.encode = faulty
            with pytest.raises(grpc.aio.AioRpcError) as failed:  # an ordinary error: this request only
                await stub.EncodeImages(_images((4, 5, 6)), timeout=10)
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            await asyncio.sleep(1.0)
            assert [s for s, _ in watch.statuses] == [SERVING]

            with pytest.raises(grpc.aio.AioRpcError) as fatal:
                await stub.EncodeImages(_images((7, 8, 9)), timeout=10)
            died = time.monotonic()
            assert fatal.value.code() == grpc.StatusCode.UNAVAILABLE and "EncoderKilled" in fatal.value.details()
            assert await watch.wait_for(NOT_SERVING, 3) - died < 1.5

            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as later:
                await stub.EncodeImages(_images((10, 11, 12)), timeout=10)
            assert later.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 0.5
            assert calls["n"] == 2  # the stopped encoder was not called again
            watch.close()

    asyncio.run(main())


def test_a_wedged_encoder_says_not_serving_after_the_bound():
    engine = VisionEngine(VisionConfig(encoder=DemoEncoderConfig(output_width=64), encoder_cache_bytes=0,
                                       wedged_after_s=1.0))
    release = threading.Event()

    async def main():
        async with serving("vision", _register(VisionServicer(engine)), engine.health, start=engine.start) as channel:
            stub = vision_pb2_grpc.VisionStub(channel)
            watch = WatchedHealth(channel)
            await watch.wait_for(SERVING, 5)
            encode = engine.core.encoder.encode

            def blocked(pixels):
                release.wait(10)
                return encode(pixels)

            engine.core.encoder.encode = blocked
            call = stub.EncodeImages(_images((1, 2, 3)), timeout=20)
            started = time.monotonic()
            waited = await watch.wait_for(NOT_SERVING, 4) - started
            assert 1.0 <= waited < 2.5  # the bound, plus up to two health polls
            engine.core.encoder.encode = encode
            release.set()
            assert len((await call).images) == 1
            watch.statuses.clear()
            await watch.wait_for(SERVING, 3)  # encodes complete again
            watch.close()

    asyncio.run(main())


def test_the_wedge_bound_is_a_flag():
    from services.vision.__main__ import parse_args

    assert parse_args(["--output-width", "64", "--wedged-after-s", "5"]).wedged_after_s == 5.0
    assert parse_args(["--output-width", "64"]).wedged_after_s == 60.0
    with pytest.raises(ValueError, match="wedged_after_s must be > 0"):
        VisionConfig(encoder=DemoEncoderConfig(output_width=64), wedged_after_s=0)
