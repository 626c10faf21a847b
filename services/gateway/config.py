"""Gateway configuration: where the other services are."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.server import DEFAULT_PORTS


def _check_address(field: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field} must be host:port with a port in 1..65535, got {value!r}")


@dataclass(frozen=True)
class GatewayConfig:
    """Addresses as host:port. `vision` may be empty: then image parts are refused."""

    address: str = f"127.0.0.1:{DEFAULT_PORTS['gateway']}"
    decoder: str = f"127.0.0.1:{DEFAULT_PORTS['decoder']}"
    pooling: str = f"127.0.0.1:{DEFAULT_PORTS['pooling']}"
    adapters: str = f"127.0.0.1:{DEFAULT_PORTS['adapters']}"
    vision: str = f"127.0.0.1:{DEFAULT_PORTS['vision']}"
    max_images_per_request: int = 8

    def __post_init__(self) -> None:
        for field in ("address", "decoder", "pooling", "adapters"):
            _check_address(field, getattr(self, field))
        if self.vision:
            _check_address("vision", self.vision)
        if self.max_images_per_request < 0:
            raise ValueError(f"max_images_per_request must be >= 0, got {self.max_images_per_request}")
