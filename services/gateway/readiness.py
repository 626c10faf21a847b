"""What the gateway can serve now, by capability: the verdict its probes answer (docs/operations.md#health).

Two capabilities: `generate` (chat, completions: a decoder replica serves) and `embed` (embeddings,
rerank, score: a pooler serves). The gateway is *ready* while it can serve its core traffic:
generation in a deployment that has decoders (one of its decoder replicas has served since the
gateway started), embeddings in a pooling-only one (no decoder replica has ever served). The
registry, vision and individual replicas are dependencies whose loss degrades the gateway (no
adapter loads, no images, less capacity) without making it unready, so a load balancer keeps
sending it the traffic it can still serve. The gateway's own status ("" and tessera.v1.Gateway)
is its liveness: SERVING from the end of its start until SIGTERM, whatever its dependencies do.

On the gRPC port the verdicts are grpc.health.v1 statuses of the names in HEALTH_SERVICES, set every
POLL_S from the state of the gateway's own replica channels (the same view its router routes by:
a channel is READY only while its replica's health says SERVING); HTTP answers /health,
/health/generate and /health/embed from a fresh probe of every dependency (services/gateway/http/backend.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from grpc_health.v1 import health_pb2

from services.common.health import HealthServicer

GENERATE = "generate"
EMBED = "embed"
CAPABILITIES = (GENERATE, EMBED)
GATEWAY_SERVICE = "tessera.v1.Gateway"
# grpc.health.v1 service names of the verdicts (None: the core traffic, as HTTP /health)
HEALTH_SERVICES: dict[str | None, str] = {None: f"{GATEWAY_SERVICE}/ready",
                                          GENERATE: f"{GATEWAY_SERVICE}/{GENERATE}",
                                          EMBED: f"{GATEWAY_SERVICE}/{EMBED}"}
POLL_S = 0.5  # how often the gRPC statuses follow the replicas


@dataclass(frozen=True)
class Readiness:
    """The gateway's verdicts at one moment.

    Attributes:
        gateway: None while the gateway's own health says SERVING, else why not (starting, draining).
        generate: a decoder replica serves.
        embed: a pooler replica serves.
        has_decoders: a decoder replica has served since the gateway started (a deployment with
            decoders: its core traffic is generation).
    """

    gateway: str | None
    generate: bool
    embed: bool
    has_decoders: bool

    @property
    def core(self) -> str:
        """The capability the gateway's readiness follows: generate, or embed without decoders."""
        return GENERATE if self.has_decoders or self.generate else EMBED

    def ready(self, capability: str | None = None) -> bool:
        """Whether `capability` (None: the core traffic) can be served now.

        Raises:
            ValueError: `capability` is not None, "generate" or "embed".
        """
        if capability not in (None, *CAPABILITIES):
            raise ValueError(f"capability must be one of {CAPABILITIES} (or None for the core), got {capability!r}")
        if self.gateway is not None:
            return False
        return {GENERATE: self.generate, EMBED: self.embed}[capability or self.core]


def of_pools(core, gateway: str | None = None) -> Readiness:
    """The verdicts from the core's replica channels (no call leaves the process)."""
    generate = bool(core.decoders.replicas.ready())
    return Readiness(gateway, generate, bool(core.poolers.replicas.ready()),
                     core.decoders.replicas.ever_ready or generate)


async def follow(core, servicer: HealthServicer, poll_s: float = POLL_S) -> None:
    """Set the statuses of HEALTH_SERVICES on `servicer` from `of_pools(core)` every `poll_s`
    seconds until cancelled (after SIGTERM's `enter_graceful_shutdown` they stay NOT_SERVING)."""
    while True:
        own = await servicer.Check(health_pb2.HealthCheckRequest(service=""), None)
        serving = own.status == health_pb2.HealthCheckResponse.SERVING
        readiness = of_pools(core, None if serving else "NOT_SERVING")
        for capability, service in HEALTH_SERVICES.items():
            status = (health_pb2.HealthCheckResponse.SERVING if readiness.ready(capability)
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            await servicer.set(service, status)
        await asyncio.sleep(poll_s)


async def register(servicer: HealthServicer) -> None:
    """Make the verdicts' names known (NOT_SERVING) before the port answers, so a probe of one never
    gets NOT_FOUND while the gateway starts."""
    for service in HEALTH_SERVICES.values():
        await servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
