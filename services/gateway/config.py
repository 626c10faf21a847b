"""Gateway configuration: where the other services are.

`decoder` and `pooling` are gRPC targets that may name several replicas (`host:port`,
`ipv4:a:p,b:p`, `dns:///name:port`; services/gateway/replicas.py); the others are one host:port.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.server import DEFAULT_PORTS
from services.gateway.replicas import parse_target


def _check_address(field: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field} must be host:port with a port in 1..65535, got {value!r}")


@dataclass(frozen=True)
class GatewayConfig:
    """`decoder`, `pooling`: replica targets; the rest host:port. `vision` may be empty: then image
    parts are refused."""

    address: str = f"127.0.0.1:{DEFAULT_PORTS['gateway']}"
    decoder: str = f"127.0.0.1:{DEFAULT_PORTS['decoder']}"
    pooling: str = f"127.0.0.1:{DEFAULT_PORTS['pooling']}"
    adapters: str = f"127.0.0.1:{DEFAULT_PORTS['adapters']}"
    vision: str = f"127.0.0.1:{DEFAULT_PORTS['vision']}"
    max_images_per_request: int = 8

    def __post_init__(self) -> None:
        for field in ("address", "adapters"):
            _check_address(field, getattr(self, field))
        for field in ("decoder", "pooling"):
            try:
                parse_target(getattr(self, field))
            except ValueError as error:
                raise ValueError(f"{field}: {error}") from None
        if self.vision:
            _check_address("vision", self.vision)
        if self.max_images_per_request < 0:
            raise ValueError(f"max_images_per_request must be >= 0, got {self.max_images_per_request}")
