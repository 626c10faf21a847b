"""The public endpoint: validate, route, encode images through vision before the decoder.

Never computes model math. Generate goes to the decoder replica the router scores best
(services/gateway/router.py: prefix affinity, adapter affinity, load); pooling calls go to the
pooler with the fewest requests in flight (services/gateway/pools.py). Tokenize goes by its
`model`: empty (the served model, as vLLM's /tokenize), any of the decoder's served names
(DecoderInfo.served_model_names) or a ready adapter's name to the decoder replica with the fewest
requests in flight; a pooling model's name or alias to a pooler, which resolves it (Detokenize:
decoder models only).

A Generate whose replica fails (UNAVAILABLE) before it streamed a token is retried once on another
replica; one already streaming ends with UNAVAILABLE naming the replica as soon as its connection
breaks. Each Generate's initial metadata names its replica (`tessera-replica: host:port`).

Downstream statuses pass through unchanged (a decoder's INVALID_ARGUMENT reaches the client as
INVALID_ARGUMENT); a service that is down answers UNAVAILABLE naming it. Deadlines propagate: each
downstream call gets the client's remaining time.
"""

from __future__ import annotations

import asyncio

import grpc

from services.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    TesseraError,
    Unavailable,
    error_from_rpc,
)
from services.common.logs import REQUEST_ID_METADATA
from services.common.server import insecure_channel
from services.gateway.config import GatewayConfig
from services.gateway.convert import decoder_tokenize_request, routing_key, served_names, tokenize_response
from services.gateway.limits import GatewayLimits
from services.gateway.pools import DecoderPool, PoolerPool
from services.gateway.replicas import Replica
from tessera.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    decoder_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    pooling_pb2,
    vision_pb2,
    vision_pb2_grpc,
)

# Admin metadata the gateway relays to the registry; nothing else crosses.
_FORWARDED_METADATA = ("authorization",)
INFO_TIMEOUT_S = 5.0  # GetInfo lists a service that has not answered by then as unavailable
REPLICA_METADATA = "tessera-replica"  # initial metadata of a Generate: the decoder replica serving it


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.decoders = DecoderPool(config.decoder)
        self.poolers = PoolerPool(config.pooling)
        self._channels = {"adapters": insecure_channel(config.adapters)}
        if config.vision:
            self._channels["vision"] = insecure_channel(config.vision)
        self.adapters = adapters_pb2_grpc.AdaptersStub(self._channels["adapters"])
        self.vision = vision_pb2_grpc.VisionStub(self._channels["vision"]) if config.vision else None
        self.limits = GatewayLimits(config, self._max_model_len)

    def _max_model_len(self) -> int | None:
        """The context the decoder replicas report (they serve one model), or None before any has."""
        for replica in self.decoders.replicas.replicas.values():
            if isinstance(replica.info, decoder_pb2.DecoderInfo) and replica.info.max_model_len > 0:
                return replica.info.max_model_len
        return None

    def _no_vision_reason(self) -> str:
        """Why image parts are refused with no vision service configured: the decoder's model is
        text-only (no M-RoPE sections, as its replicas report), or images were turned off."""
        for replica in self.decoders.replicas.replicas.values():
            info = replica.info
            if isinstance(info, decoder_pb2.DecoderInfo) and info.model and not info.mrope_section:
                return (f"the decoder model {info.model!r} ({info.architecture}) is text-only; "
                        "no vision service is configured")
        return "no vision service is configured (a text-only decoder model, or `tessera up --no-vision`)"

    async def start(self) -> None:
        """Start resolving replicas and polling the decoders' load (on the server's loop)."""
        self.decoders.start()
        self.poolers.start()

    @staticmethod
    def _downstream(service: str, address: str, error: grpc.aio.AioRpcError) -> TesseraError:
        """`_downstream` with whether `service` answered the call itself: every tessera service's
        answer carries the call's x-request-id in its trailing metadata (logs.py); an error grpc
        made up on this side (connection refused, reset, a ping not acked) carries none, also while
        the channel still says READY."""
        answered = any(key == REQUEST_ID_METADATA for key, _ in (error.trailing_metadata() or ()))
        return _downstream(service, address, error, answered)

    async def close(self) -> None:
        await self.decoders.close()
        await self.poolers.close()
        for channel in self._channels.values():
            await channel.close()

    # -- generation ---------------------------------------------------------------------------

    async def Generate(self, request, context):
        request = await self._encode_images(request, context, self.limits.generate(request))
        key = routing_key(request)
        tried: list[str] = []
        failure: Exception | None = None
        while True:
            try:  # a retry takes another replica that is ready now, without waiting
                replica = await self.decoders.pick(key, tried, 0.0 if tried else context.time_remaining())
            except Unavailable:
                if failure is not None:  # no other replica to retry on: the first one's answer
                    raise failure from None
                raise
            call = replica.stub.Generate(request, timeout=context.time_remaining())
            streamed = False
            try:
                async for response in call:
                    if not streamed:
                        await context.send_initial_metadata(((REPLICA_METADATA, replica.address),))
                        streamed = True
                    yield response
                return
            except grpc.aio.AioRpcError as error:
                failure = self._downstream("decoder", replica.address, error)
                if error.code() == grpc.StatusCode.UNAVAILABLE and not streamed and not tried:
                    tried.append(replica.address)  # nothing streamed yet: once more, elsewhere
                    continue
                raise failure from error
            finally:
                call.cancel()  # client gone or finished: the decoder frees the request's KV blocks and lease
                self.decoders.finished(replica)

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
            raise InvalidArgument(f"image parts are not accepted: {self._no_vision_reason()}")
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
        return await self._pooled("Embed", request, context)

    async def Rerank(self, request, context):
        return await self._pooled("Rerank", request, context)

    # -- tokenize -----------------------------------------------------------------------------

    async def Tokenize(self, request, context):
        """By `model`: "" (the served model, as vLLM's /tokenize), any of the decoder's served names
        or a ready adapter's name: the decoder's tokenizer (one input, or chat messages), answering
        the decoder's first served name (an adapter's own); a pooling model's name or alias: that
        model's. "" goes to the default pooling model only when no decoder has reported and none
        becomes ready within the pool's wait (a cluster without a decoder)."""
        self.limits.tokenize(request)
        named = await (self._names_decoder(request.model, context) if request.model
                       else self._ask_decoder_model(context))
        if named is not None:
            self.limits.decoder_tokenize(request)
            reply = await self._decoded("Tokenize", decoder_tokenize_request(request, named), context)
            return tokenize_response(named, reply)
        if request.messages:
            raise InvalidArgument("messages are tokenized by decoder models only; "
                                  f"{await self._which_decoder(context)}")
        try:
            return await self._pooled("Tokenize", request, context)
        except NotFound as error:
            raise NotFound(f"{error}; {await self._which_decoder(context)}") from None

    async def Detokenize(self, request, context):
        """Decoder models only (any served name; the answer carries the first, an adapter's its own);
        a pooling model (or none) named is INVALID_ARGUMENT, an unknown one NOT_FOUND."""
        self.limits.detokenize(request)
        named = await self._names_decoder(request.model, context) if request.model else None
        if named is None:
            takes = await self._which_decoder(context)
            if request.model and request.model not in await self._pooling_models(context):
                raise NotFound(f"model {request.model!r} is not served; detokenize takes {takes}")
            which = f"{request.model!r} is a pooling model" if request.model else "no model is named"
            raise InvalidArgument(f"model: {which}; detokenize takes {takes}")
        reply = await self._decoded("Detokenize", request, context)
        return decoder_pb2.DetokenizeResponse(model=named, text=reply.text)

    def _decoder_names(self) -> list[str] | None:
        """The decoder replicas' served names, the first the one answers carry (they serve one model;
        DecoderInfo.model alone when the list is empty), or None before any has reported."""
        for replica in self.decoders.replicas.replicas.values():
            if isinstance(replica.info, decoder_pb2.DecoderInfo) and replica.info.model:
                return served_names(replica.info)
        return None

    async def _ask_decoder_names(self, context) -> list[str] | None:
        """`_decoder_names()`, asked of a ready replica before the first report; None when none
        becomes ready within the pool's wait (pools.READY_WAIT_S) or answers."""
        names = self._decoder_names()
        if names is not None:
            return names
        try:
            replica = (await self.decoders.ready((), context.time_remaining()))[0]
            info = await self._unary("decoder", replica.address, replica.stub.GetInfo, decoder_pb2.DecoderInfoRequest(),
                                     context, replica=replica)
        except Unavailable:
            return None
        return served_names(info) if info.model else None

    async def _ask_decoder_model(self, context) -> str | None:
        """The decoder's first served name (what answers carry), as `_ask_decoder_names`."""
        names = await self._ask_decoder_names(context)
        return names[0] if names else None

    async def _which_decoder(self, context) -> str:
        """What a decoder-only call may name, for refusals."""
        names = await self._ask_decoder_names(context)
        return (f"the decoder's model {' or '.join(map(repr, names))} or a loaded adapter's name" if names
                else "the decoder's model or a loaded adapter's name")

    async def _names_decoder(self, model: str, context) -> str | None:
        """The name to answer with when `model` names the decoder: its first served name for any of
        them, `model` itself for a ready adapter of the registry (an adapter shares its base model's
        tokenizer); None otherwise, for "" and when the registry cannot answer."""
        if not model:
            return None
        names = await self._ask_decoder_names(context)
        if names is not None and model in names:
            return names[0]
        try:
            listed = await self._unary("adapters", self.config.adapters, self.adapters.ListAdapters,
                                       adapters_pb2.ListAdaptersRequest(), context)
        except Unavailable:
            return None
        return model if any(a.name == model and a.state == "ready" for a in listed.adapters) else None

    async def _pooling_models(self, context) -> list[str]:
        """Every name a pooling request may give: each model's name and aliases ([] when no pooler answers)."""
        try:
            replica = (await self.poolers.ready((), context.time_remaining()))[0]
            info = await self._unary("pooling", replica.address, replica.stub.GetInfo, pooling_pb2.PoolingInfoRequest(),
                                     context, replica=replica)
        except Unavailable:
            return []
        return [name for m in info.models for name in (m.model, *m.aliases)] or [info.model]

    async def _decoded(self, method: str, request, context):
        """One unary decoder call on the ready replica with the fewest requests in flight."""
        replica = min(await self.decoders.ready((), context.time_remaining()), key=lambda r: r.num_outstanding)
        self.decoders.started(replica)
        try:
            return await self._unary("decoder", replica.address, getattr(replica.stub, method), request, context,
                                     replica=replica)
        finally:
            self.decoders.finished(replica)

    async def _pooled(self, method: str, request, context):
        """One pooling call on the least busy pooler; retried once on another ready pooler if that
        one could not be reached (its channel left READY)."""
        tried: list[str] = []
        failure: Exception | None = None
        while True:
            try:
                replica = await self.poolers.pick(tried, 0.0 if tried else context.time_remaining())
            except Unavailable:
                if failure is not None:  # no other pooler to retry on: the first one's answer
                    raise failure from None
                raise
            try:
                return await self._unary("pooling", replica.address, getattr(replica.stub, method), request,
                                         context, replica=replica)
            except Unavailable as error:
                if tried or replica.channel.get_state() == grpc.ChannelConnectivity.READY:
                    raise
                tried.append(replica.address)
                failure = error
            finally:
                self.poolers.finished(replica)

    async def EmbedStream(self, request_iterator, context):
        relay = _RequestRelay(self.limits.embed_stream(request_iterator))
        replica = await self.poolers.pick(remaining=context.time_remaining())
        call = replica.stub.EmbedStream(relay.requests(), timeout=context.time_remaining())
        try:
            async for response in call:
                yield response
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as error:
            relay.raise_failure()  # the client's stream broke (a message that did not parse): its status
            if isinstance(error, asyncio.CancelledError):
                raise
            raise self._downstream("pooling", replica.address, error) from error
        finally:
            call.cancel()  # client gone or finished: the pooling service drops its queued inputs
            self.poolers.finished(replica)
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
        sections = [("decoder", self.decoders, decoder_pb2.DecoderInfoRequest()),
                    ("pooling", self.poolers, pooling_pb2.PoolingInfoRequest())]
        remaining = context.time_remaining()
        # a frozen section is cut off in time to answer the others within the client's deadline too
        timeout = INFO_TIMEOUT_S if remaining is None else min(INFO_TIMEOUT_S, 0.8 * remaining)

        async def section(service, pool, section_request):
            try:
                if pool is None:
                    address, method = self.config.vision, self.vision.GetInfo
                    replica = None
                else:  # every replica serves the same model and limits: ask a ready one
                    [replica, *_] = await pool.ready((), min(timeout, 1.0))
                    address, method = replica.address, replica.stub.GetInfo
                return await self._unary(service, address, method, section_request, context, timeout, replica)
            except Unavailable as error:
                return error
            except DeadlineExceeded:
                return Unavailable(f"{service} service at {address} did not answer within {timeout:.1f} s")

        if self.vision is not None:
            sections.append(("vision", None, vision_pb2.VisionInfoRequest()))
        replies = await asyncio.gather(*(section(*s) for s in sections))  # one frozen service delays none
        for (service, *_), reply in zip(sections, replies):
            if isinstance(reply, Unavailable):
                info.unavailable.append(str(reply))
            else:
                getattr(info, service).CopyFrom(reply)
        info.replicas.extend([*self.decoders.info(), *self.poolers.info()])
        return info

    async def _unary(self, service: str, address: str, method, request, context, timeout: float | None = None,
                     replica: Replica | None = None):
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
    interceptor) or over a cap would leave both calls waiting for more requests until the deadline.
    Here the failure is kept and the downstream stream ends there (half-closed, not cancelled): the
    messages before the bad one are answered, as a direct call to the service answers them, then
    the handler raises the failure.
    """

    def __init__(self, requests):
        self._requests = requests
        self._failure: Exception | None = None

    async def requests(self):
        try:
            async for request in self._requests:
                yield request
        except Exception as error:  # noqa: BLE001 - re-raised by raise_failure on the handler's side
            self._failure = error

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


def _downstream(service: str, address: str, error: grpc.aio.AioRpcError, reachable: bool) -> TesseraError:
    """A downstream failure as its domain error (services/common/errors.py); UNAVAILABLE names the
    service (or, when that service answered it itself, says what it was relayed by)."""
    failure = error_from_rpc(error)
    if not isinstance(failure, Unavailable):
        return failure
    if reachable:  # e.g. the decoder is up but its adapter registry is not
        return Unavailable(f"{error.details()} (answered by the {service} service at {address})")
    return Unavailable(f"{service} service at {address} is unavailable: {error.details()}")
