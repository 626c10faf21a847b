"""Routing policies by name (SGLang's router: a factory over one policy interface)."""

from __future__ import annotations

from services.gateway.routing.cache_aware import CacheAwarePolicy, RouterConfig
from services.gateway.routing.least_outstanding import LeastOutstandingPolicy
from services.gateway.routing.policy import InFlight, RoutingPolicy

# cache_aware: decoder Generate (prefix affinity, adapter affinity, load);
# least_outstanding: pooling calls and unary decoder calls
POLICIES = ("cache_aware", "least_outstanding")


def create_policy(name: str, in_flight: InFlight | None = None, config: RouterConfig | None = None) -> RoutingPolicy:
    """The policy `name` over `in_flight` (a fresh count when None); `config`: cache_aware's weights.

    Raises:
        ValueError: `name` is not one of POLICIES.
    """
    if name == "cache_aware":
        return CacheAwarePolicy(config, in_flight)
    if name == "least_outstanding":
        return LeastOutstandingPolicy(in_flight)
    raise ValueError(f"routing policy {name!r} is not one of {', '.join(POLICIES)}")
