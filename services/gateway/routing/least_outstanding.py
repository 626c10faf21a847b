"""The least-outstanding policy: the ready replica with the fewest of the gateway's requests in
flight, round robin among ties. Poolers' calls and unary decoder calls (Tokenize, Detokenize)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from services.gateway.routing.policy import Decision, InFlight, RoutingKey, RoutingPolicy


class LeastOutstandingPolicy(RoutingPolicy):
    """Fewest in flight (`in_flight`), round robin among ties; the request's key plays no part."""

    def __init__(self, in_flight: InFlight | None = None) -> None:
        super().__init__(in_flight)
        self._turn = itertools.count()

    def pick(self, key: RoutingKey | None, ready: Sequence[str], now: float = 0.0) -> Decision | None:
        if not ready:
            return None
        turn = next(self._turn)
        fewest = min(self.in_flight[r] for r in ready)
        tied = [r for r in ready if self.in_flight[r] == fewest]
        return Decision(tied[turn % len(tied)])
