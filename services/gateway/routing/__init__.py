"""Which replica serves a request: one policy interface (policy.py), one file per policy, a factory."""

from services.gateway.routing.cache_aware import CacheAwarePolicy, PrefixIndex, RouterConfig, block_hashes
from services.gateway.routing.factory import POLICIES, create_policy
from services.gateway.routing.least_outstanding import LeastOutstandingPolicy
from services.gateway.routing.policy import Decision, InFlight, ReplicaReport, RoutingKey, RoutingPolicy

__all__ = ["POLICIES", "CacheAwarePolicy", "Decision", "InFlight", "LeastOutstandingPolicy", "PrefixIndex",
           "ReplicaReport", "RouterConfig", "RoutingKey", "RoutingPolicy", "block_hashes", "create_policy"]
