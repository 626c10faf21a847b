"""Gateway configuration: where the other services are, and the caps on each public request.

`decoder` and `pooling` are gRPC targets that may name several replicas (`host:port`,
`ipv4:a:p,b:p`, `dns:///name:port`; services/gateway/replicas.py); the others are one host:port.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.limits import GenerateLimits, PoolingLimits
from services.common.metrics import check_metrics_port
from services.common.server import default_address
from services.gateway.replicas import parse_target
from tessera.protocol import API_KEY_FILE_ENV, HTTP_PORT_ENV, METRICS_PORT_ENV


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
    `max_path_chars` caps LoadAdapter's path. `http_port` serves the HTTP API
    (services/gateway/http/) beside gRPC; `api_key_file` names its keys (a path: keys never go in
    argv). Raises ValueError for a bad address, target or cap.
    """

    address: str = field(default=default_address("gateway"), metadata={"help": "bind host:port"})
    decoder: str = field(default=default_address("decoder"),
                         metadata={"help": "decoder replicas: host:port, ipv4:a:p,b:p or dns:///name:port"})
    pooling: str = field(default=default_address("pooling"),
                         metadata={"help": "pooling replicas: host:port, ipv4:a:p,b:p or dns:///name:port"})
    adapters: str = field(default=default_address("adapters"), metadata={"help": "adapter registry host:port"})
    vision: str = field(default=default_address("vision"),
                        metadata={"help": "vision host:port; empty string = no vision (images refused)"})
    limits: GenerateLimits = field(default_factory=GenerateLimits)
    pooling_limits: PoolingLimits = field(default_factory=PoolingLimits)
    max_path_chars: int = field(default=4096, metadata={"help": "characters of LoadAdapter's path"})
    http_port: int = field(default=0, metadata={
        "help": "serve the OpenAI-compatible HTTP API on this port, on the gRPC address's host (0 = off)",
        "env": HTTP_PORT_ENV})
    api_key_file: str = field(default="", metadata={
        "help": "file of API keys, one a line: HTTP inference routes then need Authorization: Bearer <key> "
                "(empty = no keys)",
        "env": API_KEY_FILE_ENV})
    return_tokens_as_token_ids: bool = field(default=False, metadata={
        "help": "HTTP logprobs name each token `token_id:<id>` instead of its text (vLLM's flag; a request's "
                "return_tokens_as_token_ids overrides it)"})
    timeout_keep_alive: float = field(default=5.0, metadata={
        "help": "HTTP: close a keep-alive connection idle this long after an answer (seconds; uvicorn's and "
                "vLLM's --timeout-keep-alive)"})
    http_header_timeout: float = field(default=20.0, metadata={
        "help": "HTTP: close a connection whose request head (request line and headers) is not in this long "
                "after the connection opened or its next request began (seconds; a slowloris client)"})
    limit_concurrency: int = field(default=0, metadata={
        "help": "HTTP: answer 503 past this many open connections or requests in flight (uvicorn's "
                "--limit-concurrency; 0 = half the process's open-file limit, the rest left to gRPC)"})
    h11_max_incomplete_event_size: int = field(default=64 * 1024, metadata={
        "help": "HTTP: bytes of a request head (request line and headers) before it is refused with 400 "
                "(uvicorn's and vLLM's --h11-max-incomplete-event-size)"})
    max_body_bytes_in_flight: int = field(default=0, metadata={
        "help": "HTTP: bytes of request bodies read or held at once over all requests; a body past it is "
                "refused with 503 and Retry-After before it is read (0 = twice the chat route's body limit)"})
    metrics_port: int = field(default=0, metadata={
        "help": "also serve Prometheus /metrics on this port, same host as --address (0: off; the HTTP port "
                "serves them at /metrics)", "env": METRICS_PORT_ENV})

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
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in 0..65535 (0 = off), got {self.http_port}")
        check_metrics_port(self.metrics_port)
        for name in ("timeout_keep_alive", "http_header_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("limit_concurrency", "max_body_bytes_in_flight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = the default), got {getattr(self, name)}")
        if self.h11_max_incomplete_event_size < 1024:
            raise ValueError(f"h11_max_incomplete_event_size must be >= 1024 bytes, got "
                             f"{self.h11_max_incomplete_event_size}")
        if self.max_path_chars < 1:
            raise ValueError(f"max_path_chars must be >= 1, got {self.max_path_chars}")
