"""Gateway configuration: where the other services are, and the caps on each public request.

`decoder` and `pooling` are gRPC targets that may name several replicas (`host:port`,
`ipv4:a:p,b:p`, `dns:///name:port`; services/gateway/replicas.py); the others are one host:port.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.limits import GenerateLimits, PoolingLimits
from services.common.metrics import check_metrics_port
from services.common.server import DEFAULT_PORTS
from services.gateway.replicas import parse_target


def _check_address(field: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field} must be host:port with a port in 1..65535, got {value!r}")


@dataclass(frozen=True)
class GatewayConfig:
    """`decoder`, `pooling`: replica targets; the rest host:port. `vision` may be empty: then image
    parts are refused.

    `limits` caps Generate requests and `pooling_limits` Embed / Rerank / Tokenize requests, as the
    decoder and pooling services do with the same flags (services/common/limits.py);
    `max_path_chars` caps LoadAdapter's path. Raises ValueError for a bad address, target or cap.
    """

    address: str = f"127.0.0.1:{DEFAULT_PORTS['gateway']}"
    decoder: str = f"127.0.0.1:{DEFAULT_PORTS['decoder']}"
    pooling: str = f"127.0.0.1:{DEFAULT_PORTS['pooling']}"
    adapters: str = f"127.0.0.1:{DEFAULT_PORTS['adapters']}"
    vision: str = f"127.0.0.1:{DEFAULT_PORTS['vision']}"
    limits: GenerateLimits = field(default_factory=GenerateLimits)
    pooling_limits: PoolingLimits = field(default_factory=PoolingLimits)
    max_path_chars: int = 4096
    metrics_port: int = field(default=0, metadata={
        "help": "also serve Prometheus /metrics on this port, same host as --address (0: off; the HTTP port "
                "serves them at /metrics)", "env": "TESSERA_METRICS_PORT"})

    def __post_init__(self) -> None:
        for name in ("address", "adapters"):
            _check_address(name, getattr(self, name))
        for name in ("decoder", "pooling"):
            try:
                parse_target(getattr(self, name))
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
        if self.vision:
            _check_address("vision", self.vision)
        check_metrics_port(self.metrics_port)
        if self.max_path_chars < 1:
            raise ValueError(f"max_path_chars must be >= 1, got {self.max_path_chars}")
