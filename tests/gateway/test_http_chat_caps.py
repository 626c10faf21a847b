"""The chat route checks the gateway's caps (services/common/limits.py) on the request it builds
before any image's bytes are copied into it: a body over the image or prompt cap is 400 naming the
cap, with no data URI copied and no call to the core; one within the caps reaches the core with
every image in place. In process (ASGI calls over the app, no sockets)."""

from __future__ import annotations

import base64
import json

import pytest

from services.common.limits import GenerateLimits, check_generate
from services.gateway.http.app import create_app
from services.gateway.http.backend import Backend
from tessera.v1 import decoder_pb2, gateway_pb2

from .test_http_app import App, UnreachableCore, call, error_of

IMAGE_URI = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + bytes(3000)).decode()


class RecordingLimits:
    """The core's caps; each check records the bytes of every image part's data URI at that moment."""

    def __init__(self, limits: GenerateLimits) -> None:
        self.limits = limits
        self.image_bytes_seen: list[list[int]] = []

    def generate(self, request) -> int:
        parts = [part for message in request.messages for part in message.content]
        self.image_bytes_seen.append([len(p.image.data_uri) for p in parts if p.WhichOneof("part") == "image"])
        check_generate(request, self.limits, None)
        return 0


class CappedCore(UnreachableCore):
    """An UnreachableCore with caps whose decoder model is "m"; the Generate requests that reach it are kept."""

    def __init__(self, limits: GenerateLimits) -> None:
        self.limits = RecordingLimits(limits)
        self.generated: list = []

    async def info(self, call):
        return gateway_pb2.ClusterInfo(decoder=decoder_pb2.DecoderInfo(model="m"))

    async def generate(self, request, call):
        self.generated.append(request)
        async for response in super().generate(request, call):
            yield response


@pytest.fixture
def capped():
    core = CappedCore(GenerateLimits(max_images=2, max_prompt_chars=100))
    app = App(max_body_bytes=1 << 20)
    app.asgi = create_app(Backend(core, {}, frozenset()), max_body_bytes=1 << 20)
    yield app, core
    app.close()


def _chat(num_images: int, text: str = "Compare these.") -> bytes:
    content = [{"type": "image_url", "image_url": {"url": IMAGE_URI}} for _ in range(num_images)]
    return json.dumps({"model": "m", "max_tokens": 1,
                       "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]}).encode()


def test_too_many_images_are_refused_before_any_image_is_copied(capped):
    app, core = capped
    status, answer = call(app, "/v1/chat/completions", _chat(3))
    assert status == 400, answer
    assert "has 3 images; the limit is 2 (--max-images)" in error_of(answer)["message"], answer
    assert core.limits.image_bytes_seen == [[0, 0, 0]]  # checked while every image part was still empty
    assert core.generated == []


def test_prompt_text_over_its_cap_is_refused_before_any_image_is_copied(capped):
    app, core = capped
    status, answer = call(app, "/v1/chat/completions", _chat(2, "x" * 101))
    assert status == 400, answer
    assert "prompt text has 101 characters; the limit is 100 (--max-prompt-chars" in error_of(answer)["message"]
    assert core.limits.image_bytes_seen == [[0, 0]]
    assert core.generated == []


def test_a_request_within_the_caps_reaches_the_core_with_its_images(capped):
    app, core = capped
    status, answer = call(app, "/v1/chat/completions", _chat(2))
    assert status == 503, answer  # the core's services do not answer
    assert core.limits.image_bytes_seen == [[0, 0]]
    [request] = core.generated
    images = [p.image.data_uri for p in request.messages[0].content if p.WhichOneof("part") == "image"]
    assert images == [IMAGE_URI, IMAGE_URI]
