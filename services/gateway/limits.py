"""The gateway's request caps: every public RPC is checked here before any downstream call.

Generate runs the decoder's own checks (`services.common.limits.check_generate`, same caps by
the same flags) with the decoder's context, so a request the decoder would refuse never has its
images encoded. The context comes from the decoder replicas' GetInfo reports, which the gateway
polls anyway for routing; until the first report, the checks that need it are left to the decoder.

Image token budget: what the vision service may expand a request's images to is the context less
max_tokens (`EncodeImagesRequest.max_image_tokens`). With the context known, the core also asks a
decoder for the rest of the prompt's tokens (text, chat template, vision start/end: Decoder.
CountPromptTokens, before any image is encoded), and vision refuses a prompt whose text, images
and max_tokens overflow the context (`EncodeImagesRequest.prompt`). Both are checked from the
image headers (each image's size through the processor's resize rule), before decoding or
encoding anything; the decoder's own context check still applies to what it builds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from services.common.errors import InvalidArgument
from services.common.limits import (
    check_chars,
    check_decoder_tokenize,
    check_detokenize,
    check_embed,
    check_generate,
    check_rerank,
    check_tokenize,
)
from services.common.streams import DRAIN_TIMEOUT_S
from services.gateway.config import GatewayConfig


class GatewayLimits:
    """Checks one request of each public RPC; raises InvalidArgument naming the field, its size
    and the limit (with its flag).

    `max_model_len()` answers the decoder's context in tokens, or None while no decoder has
    reported one.
    """

    def __init__(self, config: GatewayConfig, max_model_len: Callable[[], int | None]) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def generate(self, request) -> int:
        """Checks a GenerateRequest; returns its image token budget (0 = unknown: no budget): the
        context less max_tokens, or less one generated token when max_tokens is unset."""
        max_model_len = self.max_model_len()
        check_generate(request, self.config.limits, max_model_len)
        return 0 if max_model_len is None else max_model_len - max(request.sampling.max_tokens, 1)

    def embed(self, request) -> None:
        check_embed(request, self.config.pooling_limits)

    async def embed_stream(self, requests: AsyncIterator) -> AsyncIterator:
        """`requests`, each checked as it arrives; the first over a cap ends the stream with it, once
        the client has sent its last message (read and dropped: see services/common/streams.py)."""
        async for request in requests:
            try:
                self.embed(request)
            except InvalidArgument:
                try:
                    async with asyncio.timeout(DRAIN_TIMEOUT_S):
                        async for _ in requests:
                            pass
                except TimeoutError:
                    pass
                raise
            yield request

    def rerank(self, request) -> None:
        check_rerank(request, self.config.pooling_limits)

    def tokenize(self, request) -> None:
        check_tokenize(request, self.config.pooling_limits)

    def decoder_tokenize(self, request) -> None:
        """A TokenizeRequest for the decoder's tokenizer: Generate's prompt caps over its inputs and messages."""
        check_decoder_tokenize("inputs and messages", [*request.inputs, request.tools], request.messages, self.config.limits,
                               self.max_model_len())

    def detokenize(self, request) -> None:
        check_detokenize(request, self.config.limits, self.max_model_len())

    def adapter_request(self, request) -> None:
        """LoadAdapter / UnloadAdapter: the name, and the path where there is one."""
        check_chars("name", request.name, self.config.limits.max_name_chars, "max_name_chars")
        if hasattr(request, "path"):
            check_chars("path", request.path, self.config.max_path_chars, "max_path_chars")
