"""What the HTTP routes call: the gateway's in-process core (services/gateway/core.py), the served
models' names, API keys, and the health of every dependency (services/gateway/readiness.py).

The HTTP door is a second adapter over the same core as the gRPC servicer: routing, caps, image
encoding and adapter auth happen there exactly as for gRPC clients, and every refusal is the same
domain error a gRPC client gets as a status (errors.py maps it to HTTP).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from services.common.errors import ResourceExhausted, TesseraError
from services.common.healthcheck import not_serving, probe
from services.gateway.core import Call
from services.gateway.http.chat.tools import DecoderTools
from services.gateway.http.errors import ApiError
from services.gateway.readiness import Readiness
from tessera.protocol import MESSAGE_TOO_LARGE
from tessera.v1 import gateway_pb2

INFO_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 2.0
ALIAS_REFRESH_S = 5.0  # the shortest wait before the pooling models' names are asked again for an unknown one


@dataclass(frozen=True)
class HealthReport:
    """What /health answers: `readiness` (what can be served now), `not_serving` (each dependency
    with nothing serving, "service: why"; the gateway's own status as "gateway: ...") and
    `degraded` (each replica down beside others of its service that serve, "service replica
    address: why")."""

    readiness: Readiness
    not_serving: list[str]
    degraded: list[str]

    def status(self, capability: str | None = None) -> str:
        """"unavailable" when `capability` (None: the core traffic) cannot be served, else "ok" with
        nothing listed, "degraded" with something (ValueError for an unknown capability)."""
        if not self.readiness.ready(capability):
            return "unavailable"
        return "degraded" if self.not_serving or self.degraded else "ok"


@dataclass(frozen=True)
class DecoderNames:
    """The decoder's model names: `base` is what answers and /v1/models name it (its first
    --served-model-name), `grpc` what the gateway's gRPC API calls it (DecoderInfo.model), and
    `accepted` every name a request's `model` may give it (the aliases too)."""

    base: str
    grpc: str
    accepted: frozenset[str]

    @classmethod
    def of(cls, info) -> DecoderNames:
        names = list(info.served_model_names) or [info.model]
        return cls(base=names[0], grpc=info.model, accepted=frozenset(names) | {info.model})


async def _always_serving() -> str | None:
    return None


def _has_decoders() -> bool:
    return True


class Backend:
    """The core, the served models' names, and the health of every required service.

    `core`: a `GatewayCore` (or an object with its methods); `services` maps each required service
    other than the gateway to the address its health is asked at ("vision" absent when none is
    configured); decoder and pooling replicas are the ones the core's info lists. `gateway_health`:
    the gateway's own grpc.health.v1 verdict (None = SERVING, else why), as its gRPC port answers it.
    `max_request_bytes`: the largest request the gateway's gRPC port accepts; a route's request
    past it is refused as that port refuses it (0: no limit). `has_decoders`: whether a decoder
    replica has served since the gateway started (readiness.Readiness.has_decoders; default: a
    deployment with decoders).
    """

    def __init__(self, core, services: dict[str, str], api_keys: frozenset[str] = frozenset(),
                 gateway_health: Callable[[], Awaitable[str | None]] = _always_serving, max_request_bytes: int = 0,
                 has_decoders: Callable[[], bool] = _has_decoders):
        self.core = core
        self.services = services
        self.api_keys = api_keys
        self.gateway_health = gateway_health
        self.has_decoders = has_decoders
        self.max_request_bytes = max_request_bytes
        self._health_channels: dict[str, grpc.aio.Channel] = {}
        self._decoder_names: DecoderNames | None = None
        self._decoder_tools = DecoderTools(False, "")
        self._pooling_names: dict[str, str] = {}  # every pooling model's name and alias -> its name
        self._pooling_asked = float("-inf")

    async def close(self) -> None:
        for channel in self._health_channels.values():
            await channel.close()

    def check_api_key(self, authorization: str | None) -> None:
        """Raises ApiError 401 unless keys are off or `Authorization: Bearer <key>` names one."""
        if not self.api_keys:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "this endpoint needs an API key: send Authorization: Bearer <key>",
                           "authentication_error")
        if not any(hmac.compare_digest(key.strip().encode(), k.encode()) for k in self.api_keys):
            raise ApiError(401, "the API key is not valid", "authentication_error")

    def check_generate(self, request) -> None:
        """The core's caps on a GenerateRequest (counts, names, text; services/common/limits.py).

        Raises:
            InvalidArgument: the first cap passed, naming it.
        """
        limits = getattr(self.core, "limits", None)  # a core without caps (tests) checks none
        if limits is not None:
            limits.generate(request)

    def check_size(self, request) -> None:
        """Raises ResourceExhausted (413) for a request larger than the gRPC port would take."""
        if self.max_request_bytes and (size := request.ByteSize()) > self.max_request_bytes:
            raise ResourceExhausted(f"the request is {size} bytes as protobuf: larger than max "
                                    f"({self.max_request_bytes} bytes, the gateway's message limit)",
                                    reason=MESSAGE_TOO_LARGE)

    async def info(self, timeout_s: float = INFO_TIMEOUT_S) -> gateway_pb2.ClusterInfo:
        return await self.core.info(Call.within(timeout_s))

    async def decoder_names(self) -> DecoderNames:
        """The decoder's model names (asked once; every replica serves the same model).

        Raises:
            ApiError: 503 when no decoder has answered yet.
        """
        if self._decoder_names is None:
            info = await self.info()
            if not info.decoder.model:
                raise ApiError(503, "the decoder has not answered yet: " + "; ".join(info.unavailable),
                               "service_unavailable")
            self._decoder_names = DecoderNames.of(info.decoder)
            self._decoder_tools = DecoderTools.of(info.decoder)
        return self._decoder_names

    async def decoder_tools(self) -> DecoderTools:
        """What the served model's chat template does with tools and the decoder's tool-call parser
        (asked once, with the names; raises ApiError 503 as `decoder_names`)."""
        await self.decoder_names()
        return self._decoder_tools

    async def base_model(self) -> str:
        """The base model's name in answers (raises ApiError 503 as `decoder_names`)."""
        return (await self.decoder_names()).base

    async def lora_for(self, model: str) -> str:
        """`model` as Generate's `lora`: "" for the base model (any of its names), else the adapter
        name (the decoder answers NOT_FOUND -> 404 for a name the registry does not hold)."""
        if not model:
            raise ApiError(400, "model must name the base model or a loaded adapter", param="model")
        return "" if model in (await self.decoder_names()).accepted else model

    async def pooling_model(self, model: str | None) -> str:
        """`model` as the pooling service names it: an alias (--served-model-name) becomes its
        model's name; "" (its default) and names it does not list pass unchanged (the pooling
        service answers NOT_FOUND for an unknown one). The names are asked again, at most every
        ALIAS_REFRESH_S, when a name is not among them."""
        if not model:
            return ""
        if model not in self._pooling_names and time.monotonic() - self._pooling_asked >= ALIAS_REFRESH_S:
            self._pooling_asked = time.monotonic()
            try:
                info = await self.info()
            except TesseraError:
                return model  # the call that follows reports the outage
            listed = list(info.pooling.models) or ([info.pooling] if info.pooling.model else [])
            self._pooling_names = {name: m.model for m in listed
                                   for name in (m.model, *getattr(m, "aliases", ()))}
        return self._pooling_names.get(model, model)

    async def tokenizer_model(self, model: str | None) -> str:
        """`model` as the gateway's Tokenize / Detokenize take it: a name of the decoder's model
        becomes its gRPC name, a pooling alias its model's name; "" stays ""."""
        if not model:
            return ""
        try:
            names = await self.decoder_names()
        except ApiError:
            names = None  # no decoder: the name can only be a pooling model's
        if names is not None and model in names.accepted:
            return names.grpc
        return await self.pooling_model(model)

    async def health(self) -> HealthReport:
        """One probe of every dependency (each health Check bounded by HEALTH_TIMEOUT_S): what can be
        served (readiness.Readiness), each dependency with nothing serving, and each replica down
        beside replicas of its service that serve."""
        checks = {name: address for name, address in self.services.items() if name not in ("decoder", "pooling")}
        try:
            info = await self.info(HEALTH_TIMEOUT_S * 2)
            replicas = [(r.service, r.address) for r in info.replicas]
        except TesseraError as error:
            why = f"{error.code.name} {error}"
            return HealthReport(Readiness(why, False, False, self.has_decoders()), [f"gateway: {why}"], [])
        names = ["gateway", *checks, *(f"{s}@{a}" for s, a in replicas)]
        verdicts = await asyncio.gather(self._gateway(),
                                        *(self._check(a) for a in checks.values()),
                                        *(self._check(a) for _, a in replicas))
        by_service: dict[str, list[str | None]] = {}
        for name, verdict in zip(names, verdicts):
            by_service.setdefault(name.split("@")[0], []).append(verdict)
        for service in ("decoder", "pooling"):
            by_service.setdefault(service, ["no replica known"])
        problems = [f"{service}: {results[0]}" for service, results in by_service.items() if all(results)]
        degraded = [f"{service} replica {address}: {verdict}"
                    for (service, address), verdict in zip(replicas, verdicts[1 + len(checks):])
                    if verdict and not all(by_service[service])]
        generate, embed = not all(by_service["decoder"]), not all(by_service["pooling"])
        readiness = Readiness(verdicts[0], generate, embed, self.has_decoders() or generate)
        return HealthReport(readiness, problems, degraded)

    async def _gateway(self) -> str | None:
        reason = await self.gateway_health()
        return None if reason is None else f"gateway {reason}"

    async def _check(self, address: str) -> str | None:
        """None when `address`'s grpc.health.v1 says SERVING, else why."""
        channel = self._health_channels.get(address)
        if channel is None:
            channel = self._health_channels[address] = grpc.aio.insecure_channel(address)
        verdict = await probe(channel, timeout_s=HEALTH_TIMEOUT_S)
        return None if verdict is None else f"{address} {verdict}"


def health_of(servicer) -> Callable[[], Awaitable[str | None]]:
    """The gateway's own verdict from its grpc.health.v1 servicer (`serve(health_servicer=...)`):
    None while it says SERVING, else the status's name (NOT_SERVING before the start and from
    SIGTERM on)."""

    async def verdict() -> str | None:
        return not_serving(await servicer.Check(health_pb2.HealthCheckRequest(), None))  # "" is always set: no abort

    return verdict
