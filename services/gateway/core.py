"""The gateway's one in-process core: caps, image encoding through vision, adapter resolution,
replica choice and retries, under both APIs.

The gRPC servicer (services/gateway/servicer.py) and the HTTP routes (services/gateway/http/) are
thin adapters over `GatewayCore`: protobuf in, protobuf out, domain errors
(services/common/errors.py) raised; each request comes with a `Call` saying what the core knows of
its caller (its deadline, its admin credentials). Never computes model math.

Generate goes to the decoder replica the routing policy scores best (services/gateway/routing/:
prefix affinity, adapter affinity, load); pooling calls go to the pooler with the fewest requests
in flight. Tokenize goes by its `model`: empty (the served model, as vLLM's /tokenize), any of the
decoder's served names (DecoderInfo.served_model_names) or a ready adapter's name to the decoder
replica with the fewest requests in flight; a pooling model's name or alias to a pooler, which
resolves it (Detokenize: decoder models only).

A Generate whose replica fails (UNAVAILABLE) before it streamed a token is retried once on another
replica; one already streaming ends with UNAVAILABLE naming the replica as soon as its connection
breaks. Closing a Generate's response iterator (a client gone, a cancelled task) cancels its
decoder call, which frees the request's KV blocks and adapter lease.

Downstream statuses pass through as their domain errors (a decoder's INVALID_ARGUMENT stays
InvalidArgument); a service that is down is Unavailable naming it. Deadlines propagate: each
downstream call gets the caller's remaining time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TesseraError,
    Unavailable,
    answered_by_service,
    error_from_rpc,
)
from services.common.server import insecure_channel
from services.gateway.config import GatewayConfig
from services.gateway.convert import (
    decoder_tokenize_request,
    routing_key,
    served_names,
    tokenize_response,
    without_image_bytes,
)
from services.gateway.limits import GatewayLimits
from services.gateway.pools import DecoderPool, PoolerPool
from tessera.protocol import API_KEYS_METADATA, AUTHORIZATION_METADATA, MESSAGE_TOO_LARGE
from tessera.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    decoder_pb2,
    gateway_pb2,
    pooling_pb2,
    vision_pb2,
    vision_pb2_grpc,
)

INFO_TIMEOUT_S = 5.0  # GetInfo lists a service that has not answered by then as unavailable


@dataclass
class Call:
    """The caller of one core request, whichever API it came through.

    `deadline`: time.monotonic() seconds by which the caller wants its answer (None: no deadline);
    `authorization`: the caller's `authorization` credentials, relayed to the adapter registry
    (which checks its admin token on LoadAdapter / UnloadAdapter), nothing else crosses;
    `replica`: set by `GatewayCore.generate` to the decoder replica serving it, before its first
    response.
    """

    deadline: float | None = None
    authorization: str | None = None
    replica: str = ""

    @classmethod
    def within(cls, timeout_s: float | None, authorization: str | None = None) -> Call:
        """A call that must be answered within `timeout_s` seconds from now (None: no deadline)."""
        return cls(None if timeout_s is None else time.monotonic() + timeout_s, authorization)

    def time_remaining(self) -> float | None:
        """Seconds left before the deadline (never below 0), or None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def metadata(self) -> list[tuple[str, str]]:
        return [(AUTHORIZATION_METADATA, self.authorization)] if self.authorization else []


class GatewayCore:
    """Everything the gateway does for a request, for both of its APIs (module docstring)."""

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

    async def start(self) -> None:
        """Start resolving replicas and polling the decoders' load (on the server's loop)."""
        self.decoders.start()
        self.poolers.start()

    async def close(self) -> None:
        await self.decoders.close()
        await self.poolers.close()
        for channel in self._channels.values():
            await channel.close()

    def _decoder_infos(self):
        return [r.info for r in self.decoders.replicas.replicas.values() if isinstance(r.info, decoder_pb2.DecoderInfo)]

    def _max_model_len(self) -> int | None:
        """The context the decoder replicas report (they serve one model), or None before any has."""
        return next((info.max_model_len for info in self._decoder_infos() if info.max_model_len > 0), None)

    def _no_vision_reason(self) -> str:
        """Why image parts are refused with no vision service configured: the decoder's model is
        text-only (no M-RoPE sections, as its replicas report), or images were turned off."""
        for info in self._decoder_infos():
            if info.model and not info.mrope_section:
                return (f"the decoder model {info.model!r} ({info.architecture}) is text-only; "
                        "no vision service is configured")
        return "no vision service is configured (a text-only decoder model, or `tessera up --no-vision`)"

    @staticmethod
    def _downstream(service: str, address: str, error: grpc.aio.AioRpcError) -> TesseraError:
        """`downstream_error` for a call to `service` at `address`."""
        return downstream_error(service, address, error)

    # -- generation ---------------------------------------------------------------------------

    async def generate(self, request: decoder_pb2.GenerateRequest,
                       call: Call) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        """The decoder's responses for `request`; `call.replica` names the replica before the first.

        Raises:
            TesseraError: a refusal (caps, vision, the decoder) or the replica's failure.
        """
        request = await self._encode_images(request, call, self.limits.generate(request))
        key = routing_key(request)
        tried: list[str] = []
        failure: Exception | None = None
        while True:
            try:  # a retry takes another replica that is ready now, without waiting
                replica = await self.decoders.pick(key, tried, 0.0 if tried else call.time_remaining())
            except Unavailable:
                if failure is not None:  # no other replica to retry on: the first one's answer
                    raise failure from None
                raise
            stream = replica.stub.Generate(request, timeout=call.time_remaining())
            streamed = False
            try:
                async for response in stream:
                    if not streamed:
                        call.replica, streamed = replica.address, True
                    yield response
                return
            except grpc.aio.AioRpcError as error:
                failure = self._downstream("decoder", replica.address, error)
                if error.code() == grpc.StatusCode.UNAVAILABLE and not streamed and not tried:
                    tried.append(replica.address)  # nothing streamed yet: once more, elsewhere
                    continue
                raise failure from error
            finally:
                stream.cancel()  # caller gone or finished: the decoder frees the request's KV blocks and lease
                self.decoders.finished(replica)

    async def _encode_images(self, request: decoder_pb2.GenerateRequest, call: Call,
                             max_image_tokens: int) -> decoder_pb2.GenerateRequest:
        """Replace every `image` part with the vision service's `encoded_image`, in order; vision
        refuses images that expand past `max_image_tokens` (0 = no budget: the context is not known
        yet), or that overflow the context with the rest of the prompt (`_prompt_budget`), before
        encoding any."""
        parts = [*request.prompt, *(p for m in request.messages for p in m.content)]
        images = [p for p in parts if p.WhichOneof("part") == "image"]
        if any(p.WhichOneof("part") == "encoded_image" for p in parts):
            raise InvalidArgument("clients send image parts; encoded_image parts come only from the vision service")
        if not images:
            return request
        if self.vision is None:
            raise InvalidArgument(f"image parts are not accepted: {self._no_vision_reason()}")
        prompt = await self._prompt_budget(request, call) if max_image_tokens else None
        try:
            encoded = await self.vision.EncodeImages(
                vision_pb2.EncodeImagesRequest(images=[p.image for p in images], max_image_tokens=max_image_tokens,
                                               prompt=prompt),
                timeout=call.time_remaining())
        except grpc.aio.AioRpcError as error:
            raise self._downstream("vision", self.config.vision, error) from error
        out = decoder_pb2.GenerateRequest()
        out.CopyFrom(request)
        rewritten = [p for p in [*out.prompt, *(p for m in out.messages for p in m.content)]
                     if p.WhichOneof("part") == "image"]
        for part, image in zip(rewritten, encoded.images, strict=True):
            part.encoded_image.CopyFrom(image)  # setting the oneof clears `image`
        return out

    async def _prompt_budget(self, request: decoder_pb2.GenerateRequest, call: Call) -> vision_pb2.PromptBudget:
        """What a request's images share the context with: the rest of its prompt as a decoder
        counts it (CountPromptTokens: text, chat template, vision start/end tokens; the images' bytes
        are not sent) and max_tokens. Raises the decoder's refusal of the prompt (InvalidArgument),
        Unavailable when no decoder answers."""
        count = await self._decoded("CountPromptTokens", without_image_bytes(request), call)
        return vision_pb2.PromptBudget(num_text_tokens=count.num_text_tokens, max_tokens=request.sampling.max_tokens,
                                       max_model_len=count.max_model_len)

    # -- pooling ------------------------------------------------------------------------------

    async def embed(self, request: pooling_pb2.EmbedRequest, call: Call) -> pooling_pb2.EmbedResponse:
        self.limits.embed(request)
        return await self._pooled("Embed", request, call)

    async def rerank(self, request: pooling_pb2.RerankRequest, call: Call) -> pooling_pb2.RerankResponse:
        self.limits.rerank(request)
        return await self._pooled("Rerank", request, call)

    async def embed_stream(self, requests: AsyncIterator[pooling_pb2.EmbedRequest],
                           call: Call) -> AsyncIterator[pooling_pb2.EmbedResponse]:
        """Each request's embeddings, in order, over one pooler's stream."""
        relay = _RequestRelay(self.limits.embed_stream(requests))
        replica = await self.poolers.pick(remaining=call.time_remaining())
        stream = replica.stub.EmbedStream(relay.requests(), timeout=call.time_remaining())
        try:
            async for response in stream:
                yield response
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as error:
            relay.raise_failure()  # the client's stream broke (a message that did not parse): its status
            if isinstance(error, asyncio.CancelledError):
                raise
            raise self._downstream("pooling", replica.address, error) from error
        finally:
            stream.cancel()  # client gone or finished: the pooling service drops its queued inputs
            self.poolers.finished(replica)
        relay.raise_failure()

    async def _pooled(self, method: str, request, call: Call):
        """One pooling call on the least busy pooler; retried once on another ready pooler if that
        one could not be reached (its channel left READY)."""
        tried: list[str] = []
        failure: Exception | None = None
        while True:
            try:
                replica = await self.poolers.pick(None, tried, 0.0 if tried else call.time_remaining())
            except Unavailable:
                if failure is not None:  # no other pooler to retry on: the first one's answer
                    raise failure from None
                raise
            try:
                return await self._unary("pooling", replica.address, getattr(replica.stub, method), request, call)
            except Unavailable as error:
                if tried or replica.channel.get_state() == grpc.ChannelConnectivity.READY:
                    raise
                tried.append(replica.address)
                failure = error
            finally:
                self.poolers.finished(replica)

    # -- tokenize -----------------------------------------------------------------------------

    async def tokenize(self, request: pooling_pb2.TokenizeRequest, call: Call) -> pooling_pb2.TokenizeResponse:
        """By `model`: "" (the served model, as vLLM's /tokenize), any of the decoder's served names
        or a ready adapter's name: the decoder's tokenizer (one input, or chat messages), answering
        the decoder's first served name (an adapter's own); a pooling model's name or alias: that
        model's. "" goes to the default pooling model only when no decoder has reported and none
        becomes ready within the pool's wait (a cluster without a decoder)."""
        self.limits.tokenize(request)
        named = await (self._names_decoder(request.model, call) if request.model
                       else self._ask_decoder_model(call))
        if named is not None:
            self.limits.decoder_tokenize(request)
            reply = await self._decoded("Tokenize", decoder_tokenize_request(request, named), call)
            return tokenize_response(named, reply)
        if request.messages or request.tools:
            raise InvalidArgument("messages (and their tools) are tokenized by decoder models only; "
                                  f"{await self._which_decoder(call)}")
        try:
            return await self._pooled("Tokenize", request, call)
        except NotFound as error:
            raise NotFound(f"{error}; {await self._which_decoder(call)}") from None

    async def detokenize(self, request: decoder_pb2.DetokenizeRequest, call: Call) -> decoder_pb2.DetokenizeResponse:
        """Decoder models only: "" (the served model, as vLLM's /detokenize) or any served name (the
        answer carries the first, an adapter's its own); a pooling model named is INVALID_ARGUMENT,
        an unknown one NOT_FOUND, and "" without a decoder UNAVAILABLE."""
        self.limits.detokenize(request)
        named = await (self._names_decoder(request.model, call) if request.model
                       else self._ask_decoder_model(call))
        if named is None:
            takes = await self._which_decoder(call)
            if not request.model:
                raise Unavailable(f"no decoder has reported its model; detokenize takes {takes}")
            if request.model not in await self._pooling_models(call):
                raise NotFound(f"model {request.model!r} is not served; detokenize takes {takes}")
            raise InvalidArgument(f"model: {request.model!r} is a pooling model; detokenize takes {takes}",
                                  field="model")
        reply = await self._decoded("Detokenize", request, call)
        return decoder_pb2.DetokenizeResponse(model=named, text=reply.text)

    def _decoder_names(self) -> list[str] | None:
        """The decoder replicas' served names, the first the one answers carry (they serve one model;
        DecoderInfo.model alone when the list is empty), or None before any has reported."""
        return next((served_names(info) for info in self._decoder_infos() if info.model), None)

    async def _ask_decoder_names(self, call: Call) -> list[str] | None:
        """`_decoder_names()`, asked of a ready replica before the first report; None when none
        becomes ready within the pool's wait (pools.READY_WAIT_S) or answers."""
        names = self._decoder_names()
        if names is not None:
            return names
        try:
            replica = (await self.decoders.ready((), call.time_remaining()))[0]
            info = await self._unary("decoder", replica.address, replica.stub.GetInfo, decoder_pb2.DecoderInfoRequest(),
                                     call)
        except Unavailable:
            return None
        return served_names(info) if info.model else None

    async def _ask_decoder_model(self, call: Call) -> str | None:
        """The decoder's first served name (what answers carry), as `_ask_decoder_names`."""
        names = await self._ask_decoder_names(call)
        return names[0] if names else None

    async def _which_decoder(self, call: Call) -> str:
        """What a decoder-only call may name, for refusals."""
        names = await self._ask_decoder_names(call)
        return (f"the decoder's model {' or '.join(map(repr, names))} or a loaded adapter's name" if names
                else "the decoder's model or a loaded adapter's name")

    async def _names_decoder(self, model: str, call: Call) -> str | None:
        """The name to answer with when `model` names the decoder: its first served name for any of
        them, `model` itself for a ready adapter of the registry (an adapter shares its base model's
        tokenizer); None otherwise, for "" and when the registry cannot answer."""
        if not model:
            return None
        names = await self._ask_decoder_names(call)
        if names is not None and model in names:
            return names[0]
        try:
            listed = await self._unary("adapters", self.config.adapters, self.adapters.ListAdapters,
                                       adapters_pb2.ListAdaptersRequest(), call)
        except Unavailable:
            return None
        return model if any(a.name == model and a.state == "ready" for a in listed.adapters) else None

    async def _pooling_models(self, call: Call) -> list[str]:
        """Every name a pooling request may give: each model's name and aliases ([] when no pooler answers)."""
        try:
            replica = (await self.poolers.ready((), call.time_remaining()))[0]
            info = await self._unary("pooling", replica.address, replica.stub.GetInfo, pooling_pb2.PoolingInfoRequest(),
                                     call)
        except Unavailable:
            return []
        return [name for m in info.models for name in (m.model, *m.aliases)] or [info.model]

    async def _decoded(self, method: str, request, call: Call):
        """One unary decoder call on the replica the pool's unary policy picks (least outstanding)."""
        replica = await self.decoders.pick_unary(call.time_remaining())
        try:
            return await self._unary("decoder", replica.address, getattr(replica.stub, method), request, call)
        finally:
            self.decoders.finished(replica)

    # -- adapters -----------------------------------------------------------------------------

    async def load_adapter(self, request: adapters_pb2.LoadAdapterRequest, call: Call) -> adapters_pb2.AdapterInfo:
        """An admin call: the registry checks `call.authorization` against its admin token (a gateway
        with API keys says so, and a registry without an admin token refuses it: services/adapters/auth.py)."""
        self.limits.adapter_request(request)
        return await self._admin(self.adapters.LoadAdapter, request, call)

    async def unload_adapter(self, request: adapters_pb2.UnloadAdapterRequest,
                             call: Call) -> adapters_pb2.UnloadAdapterResponse:
        """An admin call, as `load_adapter`."""
        self.limits.adapter_request(request)
        return await self._admin(self.adapters.UnloadAdapter, request, call)

    async def _admin(self, method, request, call: Call):
        metadata = [*call.metadata(), *([(API_KEYS_METADATA, "on")] if self.config.api_key_file else [])]
        try:
            return await method(request, timeout=call.time_remaining(), metadata=metadata)
        except grpc.aio.AioRpcError as error:
            raise self._downstream("adapters", self.config.adapters, error) from error

    async def list_adapters(self, request: adapters_pb2.ListAdaptersRequest,
                            call: Call) -> adapters_pb2.ListAdaptersResponse:
        return await self._unary("adapters", self.config.adapters, self.adapters.ListAdapters, request, call)

    # -- info ---------------------------------------------------------------------------------

    async def info(self, call: Call) -> gateway_pb2.ClusterInfo:
        """Each service's info (a ready replica's), those that did not answer in `unavailable`, and
        every replica's state; one frozen service delays none of the others past INFO_TIMEOUT_S."""
        info = gateway_pb2.ClusterInfo()
        sections = [("decoder", self.decoders, decoder_pb2.DecoderInfoRequest()),
                    ("pooling", self.poolers, pooling_pb2.PoolingInfoRequest())]
        remaining = call.time_remaining()
        # a frozen section is cut off in time to answer the others within the caller's deadline too
        timeout = INFO_TIMEOUT_S if remaining is None else min(INFO_TIMEOUT_S, 0.8 * remaining)

        async def section(service, pool, section_request):
            try:
                if pool is None:
                    address, method = self.config.vision, self.vision.GetInfo
                else:  # every replica serves the same model and limits: ask a ready one
                    [replica, *_] = await pool.ready((), min(timeout, 1.0))
                    address, method = replica.address, replica.stub.GetInfo
                return await self._unary(service, address, method, section_request, call, timeout)
            except Unavailable as error:
                return error
            except DeadlineExceeded:
                return Unavailable(f"{service} service at {address} did not answer within {timeout:.1f} s")

        if self.vision is not None:
            sections.append(("vision", None, vision_pb2.VisionInfoRequest()))
        replies = await asyncio.gather(*(section(*s) for s in sections))
        for (service, *_), reply in zip(sections, replies):
            if isinstance(reply, Unavailable):
                info.unavailable.append(str(reply))
            else:
                getattr(info, service).CopyFrom(reply)
        info.replicas.extend([*self.decoders.info(), *self.poolers.info()])
        return info

    async def _unary(self, service: str, address: str, method, request, call: Call, timeout: float | None = None):
        """`method(request)` downstream with the caller's remaining time (or `timeout`) and its admin metadata."""
        try:
            return await method(request, timeout=call.time_remaining() if timeout is None else timeout,
                                metadata=call.metadata())
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
        except Exception as error:  # re-raised by raise_failure on the handler's side
            self._failure = error

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


def downstream_error(service: str, address: str, error: grpc.aio.AioRpcError) -> TesseraError:
    """A downstream failure as its domain error (services/common/errors.py), its reason kept.

    A status the service answered itself carries tessera's ErrorInfo; one without it grpc made up
    on this side (a connection refused or reset, a ping not acked, also while the channel still says
    READY; a message past a receive limit). UNAVAILABLE names the service (or, when that service
    answered it itself, says what it was relayed by); a RESOURCE_EXHAUSTED grpc made is a message
    too large (MESSAGE_TOO_LARGE)."""
    failure = error_from_rpc(error)
    answered = answered_by_service(error)
    if isinstance(failure, ResourceExhausted) and not answered:
        return ResourceExhausted(str(failure), reason=MESSAGE_TOO_LARGE)
    if not isinstance(failure, Unavailable):
        return failure
    if answered:  # e.g. the decoder is up but its adapter registry is not
        return Unavailable(f"{error.details()} (answered by the {service} service at {address})", reason=failure.reason)
    return Unavailable(f"{service} service at {address} is unavailable: {error.details()}")
