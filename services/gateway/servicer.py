"""The public endpoint: validate, route, encode images through vision before the decoder.

Never computes model math. Downstream statuses pass through unchanged (a decoder's
INVALID_ARGUMENT reaches the client as INVALID_ARGUMENT); a service that is down answers
UNAVAILABLE naming it. Deadlines propagate: each downstream call gets the client's remaining time.
"""

from __future__ import annotations

import asyncio

import grpc

from services.common.errors import InvalidArgument, Unavailable
from services.common.server import insecure_channel
from services.gateway.config import GatewayConfig
from services.gateway.limits import GatewayLimits
from tessera.v1 import (
    adapters_pb2_grpc,
    decoder_pb2,
    decoder_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    pooling_pb2,
    pooling_pb2_grpc,
    vision_pb2,
    vision_pb2_grpc,
)

# Admin metadata the gateway relays to the registry; nothing else crosses.
_FORWARDED_METADATA = ("authorization",)
INFO_TIMEOUT_S = 5.0  # GetInfo lists a service that has not answered by then as unavailable


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, config: GatewayConfig):
        self.config = config
        self._channels = {
            "decoder": insecure_channel(config.decoder),
            "pooling": insecure_channel(config.pooling),
            "adapters": insecure_channel(config.adapters),
        }
        if config.vision:
            self._channels["vision"] = insecure_channel(config.vision)
        self.decoder = decoder_pb2_grpc.DecoderStub(self._channels["decoder"])
        self.pooling = pooling_pb2_grpc.PoolingStub(self._channels["pooling"])
        self.adapters = adapters_pb2_grpc.AdaptersStub(self._channels["adapters"])
        self.vision = vision_pb2_grpc.VisionStub(self._channels["vision"]) if config.vision else None
        self.limits = GatewayLimits(config, lambda timeout: self.decoder.GetInfo(decoder_pb2.DecoderInfoRequest(),
                                                                                 timeout=timeout))

    def _downstream(self, service: str, address: str, error: grpc.aio.AioRpcError) -> Exception:
        """`_downstream` with whether the channel to `service` is connected (it answered itself)."""
        reachable = self._channels[service].get_state() == grpc.ChannelConnectivity.READY
        return _downstream(service, address, error, reachable)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    # -- generation ---------------------------------------------------------------------------

    async def Generate(self, request, context):
        request = await self._encode_images(request, context, await self.limits.generate(request))
        call = self.decoder.Generate(request, timeout=context.time_remaining())
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as error:
            raise self._downstream("decoder", self.config.decoder, error) from error
        finally:
            call.cancel()  # client gone or finished: the decoder frees the request's KV blocks and lease

    async def _encode_images(self, request: decoder_pb2.GenerateRequest, context,
                             max_image_tokens: int) -> decoder_pb2.GenerateRequest:
        """Replace every `image` part with the vision service's `encoded_image`, in order; vision
        refuses images that expand past `max_image_tokens` (0 = no budget) before encoding any."""
        parts = [*request.prompt, *(p for m in request.messages for p in m.content)]
        images = [p for p in parts if p.WhichOneof("part") == "image"]
        if any(p.WhichOneof("part") == "encoded_image" for p in parts):
            raise InvalidArgument("clients send image parts; encoded_image parts come only from the vision service")
        if not images:
            return request
        if self.vision is None:
            raise InvalidArgument("no vision service is configured; image parts are not accepted")
        try:
            encoded = await self.vision.EncodeImages(
                vision_pb2.EncodeImagesRequest(images=[p.image for p in images], max_image_tokens=max_image_tokens),
                timeout=context.time_remaining())
        except grpc.aio.AioRpcError as error:
            raise self._downstream("vision", self.config.vision, error) from error
        out = decoder_pb2.GenerateRequest()
        out.CopyFrom(request)
        rewritten = [p for p in [*out.prompt, *(p for m in out.messages for p in m.content)]
                     if p.WhichOneof("part") == "image"]
        for part, image in zip(rewritten, encoded.images, strict=True):
            part.encoded_image.CopyFrom(image)  # setting the oneof clears `image`
        return out

    # -- pooling ------------------------------------------------------------------------------

    async def Embed(self, request, context):
        self.limits.embed(request)
        return await self._unary("pooling", self.config.pooling, self.pooling.Embed, request, context)

    async def Rerank(self, request, context):
        self.limits.rerank(request)
        return await self._unary("pooling", self.config.pooling, self.pooling.Rerank, request, context)

    async def Tokenize(self, request, context):
        self.limits.tokenize(request)
        return await self._unary("pooling", self.config.pooling, self.pooling.Tokenize, request, context)

    async def EmbedStream(self, request_iterator, context):
        relay = _RequestRelay(self.limits.embed_stream(request_iterator))
        call = self.pooling.EmbedStream(relay.requests(), timeout=context.time_remaining())
        relay.on_failure = call.cancel
        try:
            async for response in call:
                yield response
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as error:
            relay.raise_failure()  # the client's stream broke (a message that did not parse): its status
            if isinstance(error, asyncio.CancelledError):
                raise
            raise self._downstream("pooling", self.config.pooling, error) from error
        finally:
            call.cancel()  # client gone or finished: the pooling service drops its queued inputs
        relay.raise_failure()

    # -- adapters -----------------------------------------------------------------------------

    async def LoadAdapter(self, request, context):
        self.limits.adapter_request(request)
        return await self._unary("adapters", self.config.adapters, self.adapters.LoadAdapter, request, context)

    async def UnloadAdapter(self, request, context):
        self.limits.adapter_request(request)
        return await self._unary("adapters", self.config.adapters, self.adapters.UnloadAdapter, request, context)

    async def ListAdapters(self, request, context):
        return await self._unary("adapters", self.config.adapters, self.adapters.ListAdapters, request, context)

    # -- info ---------------------------------------------------------------------------------

    async def GetInfo(self, request, context):
        info = gateway_pb2.ClusterInfo()
        sections = [("decoder", self.config.decoder, self.decoder.GetInfo, decoder_pb2.DecoderInfoRequest()),
                    ("pooling", self.config.pooling, self.pooling.GetInfo, pooling_pb2.PoolingInfoRequest())]
        if self.vision is not None:
            sections.append(("vision", self.config.vision, self.vision.GetInfo, vision_pb2.VisionInfoRequest()))
        remaining = context.time_remaining()
        # a frozen section is cut off in time to answer the others within the client's deadline too
        timeout = INFO_TIMEOUT_S if remaining is None else min(INFO_TIMEOUT_S, 0.8 * remaining)

        async def section(service, address, method, section_request):
            try:
                return await self._unary(service, address, method, section_request, context, timeout)
            except Unavailable as error:
                return error
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                return Unavailable(f"{service} service at {address} did not answer within {timeout:.1f} s")

        replies = await asyncio.gather(*(section(*s) for s in sections))  # one frozen service delays none
        for (service, *_), reply in zip(sections, replies):
            if isinstance(reply, Unavailable):
                info.unavailable.append(str(reply))
            else:
                getattr(info, service).CopyFrom(reply)
        return info

    async def _unary(self, service: str, address: str, method, request, context, timeout: float | None = None):
        """`method(request)` downstream with the client's remaining time (or `timeout`) and its admin metadata."""
        metadata = [(k, v) for k, v in context.invocation_metadata() or () if k in _FORWARDED_METADATA]
        try:
            return await method(request, timeout=context.time_remaining() if timeout is None else timeout,
                                metadata=metadata)
        except grpc.aio.AioRpcError as error:
            raise self._downstream(service, address, error) from error


class _RequestRelay:
    """Forwards a client's request stream to a downstream call, keeping what breaks it.

    grpc's client call consumes the iterator it is given in a task of its own and drops whatever
    that iterator raises: a client message that does not parse (INVALID_ARGUMENT from the server
    interceptor) would leave both calls waiting for more requests until the deadline. Here the
    failure is kept, the downstream call cancelled (`on_failure`), and the handler raises it.
    """

    def __init__(self, requests):
        self._requests = requests
        self.on_failure = lambda: None
        self._failure: Exception | None = None

    async def requests(self):
        try:
            async for request in self._requests:
                yield request
        except Exception as error:  # noqa: BLE001 - re-raised by raise_failure on the handler's side
            self._failure = error
            self.on_failure()

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


def _downstream(service: str, address: str, error: grpc.aio.AioRpcError, reachable: bool) -> Exception:
    """A downstream failure: UNAVAILABLE names the service (or, when that service answered it
    itself, says what it was relayed by); other statuses pass through as they are."""
    if error.code() != grpc.StatusCode.UNAVAILABLE:
        return error
    if reachable:  # e.g. the decoder is up but its adapter registry is not
        return Unavailable(f"{error.details()} (answered by the {service} service at {address})")
    return Unavailable(f"{service} service at {address} is unavailable: {error.details()}")
