"""What the HTTP routes call: the gateway's own gRPC API over a loopback channel, and health.

The HTTP door is one more client of the public gRPC port, so routing, caps, image encoding and
adapter auth happen in the servicer exactly as for gRPC clients, and every refusal arrives as the
same status a gRPC client would get.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import logs
from services.common.server import CHANNEL_OPTIONS
from services.gateway.api_keys import bearer_interceptors
from services.gateway.http.errors import ApiError
from tessera.v1 import gateway_pb2, gateway_pb2_grpc

INFO_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 2.0
ALIAS_REFRESH_S = 5.0  # the shortest wait before the pooling models' names are asked again for an unknown one
REQUIRED = ("gateway", "adapters", "vision", "decoder", "pooling")


def loopback_address(address: str) -> str:
    """The gateway's bind address as a local client dials it (a wildcard host becomes loopback)."""
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return f"{host}:{port}"


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


class Backend:
    """The loopback stub, the served models' names, and the health of every required service.

    `services` maps each required service other than the gateway to the address its health is
    asked at ("vision" absent when none is configured); decoder and pooling replicas are the ones
    the gateway's GetInfo lists.
    """

    def __init__(self, target: str, services: dict[str, str], api_keys: frozenset[str] = frozenset(),
                 loopback_key: str = ""):
        """`target`: the gateway's gRPC API, plaintext, on this host (`loopback_address(its address)`,
        or a Unix socket); `loopback_key`: the key its gRPC port accepts from the HTTP API (when keys are on)."""
        # The HTTP request's id goes on to the gRPC port (services/common/logs.py).
        interceptors = [*logs.client_interceptors(), *(bearer_interceptors(loopback_key) if loopback_key else ())]
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS, interceptors=interceptors)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.services = services
        self.api_keys = api_keys
        self._health_channels: dict[str, grpc.aio.Channel] = {"gateway": self.channel}
        self._decoder_names: DecoderNames | None = None
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

    async def info(self) -> gateway_pb2.ClusterInfo:
        return await self.stub.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=INFO_TIMEOUT_S)

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
        return self._decoder_names

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
            except grpc.aio.AioRpcError:
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

    async def not_serving(self) -> tuple[list[str], list[str]]:
        """(down, degraded): each required service whose health is not SERVING, with why ([] = all
        serve), and each replica not SERVING beside replicas of its service that do, as
        `decoder replica host:port: why` (the service still serves: no failure alone).
        """
        checks = {name: address for name, address in self.services.items() if name not in ("decoder", "pooling")}
        problems: list[str] = []
        try:
            info = await self.stub.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=HEALTH_TIMEOUT_S * 2)
            replicas = [(r.service, r.address) for r in info.replicas]
        except grpc.aio.AioRpcError as error:
            return [f"gateway: {error.code().name} {error.details()}"], []
        names = ["gateway", *checks, *(f"{s}@{a}" for s, a in replicas)]
        verdicts = await asyncio.gather(self._check("gateway", None),
                                        *(self._check(name, a) for name, a in checks.items()),
                                        *(self._check(s, a) for s, a in replicas))
        by_service: dict[str, list[str | None]] = {}
        for name, verdict in zip(names, verdicts):
            by_service.setdefault(name.split("@")[0], []).append(verdict)
        for service in ("decoder", "pooling"):
            by_service.setdefault(service, ["no replica known"])
        for service, results in by_service.items():
            if all(results):
                problems.append(f"{service}: {results[0]}")
        degraded = [f"{service} replica {address}: {verdict}"
                    for (service, address), verdict in zip(replicas, verdicts[1 + len(checks):])
                    if verdict and not all(by_service[service])]
        return problems, degraded

    async def _check(self, name: str, address: str | None) -> str | None:
        """None when `address`'s grpc.health.v1 says SERVING, else why."""
        key = address or "gateway"
        channel = self._health_channels.get(key)
        if channel is None:
            channel = self._health_channels[key] = grpc.aio.insecure_channel(address)
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                    timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            return f"{address or 'gateway'} {error.code().name}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"{address or 'gateway'} {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        return None
