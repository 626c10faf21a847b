"""What the sync and async clients share: connection settings, call metadata, the retry rule."""

from __future__ import annotations

import dataclasses
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from tessera.client.types import SamplingParams
from tessera.protocol import ADMIN_TOKEN_ENV, API_TOKEN_ENV, TLS_ROOT_CERT_ENV

DEFAULT_ADDRESS = "localhost:50051"


@dataclass(frozen=True)
class RetryPolicy:
    """Retry a call that ended UNAVAILABLE before it returned anything (for Generate: before the
    first token), up to `max_attempts` calls in all, waiting `initial_backoff_s` doubling up to
    `max_backoff_s` (with jitter), all within the call's deadline. Other statuses are never retried."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 2.0

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts is {self.max_attempts}; at least 1 (no retry)")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(f"backoff {self.initial_backoff_s}..{self.max_backoff_s} s must satisfy "
                             "0 <= initial_backoff_s <= max_backoff_s")

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        return random.uniform(0.5, 1.0) * min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1))


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(frozen=True)
class Settings:
    """Connection settings. Tokens and the TLS root certificate come from the arguments, else from
    $TESSERA_API_TOKEN, $TESSERA_ADMIN_TOKEN and $TESSERA_TLS_ROOT_CERT (a PEM file path)."""

    address: str
    api_token: str
    admin_token: str
    tls: bool
    root_certificates: bytes | None
    timeout: float | None
    retry: RetryPolicy

    @classmethod
    def resolve(cls, address: str, *, api_token: str | None, admin_token: str | None, tls: bool | None,
                root_cert: str | os.PathLike | bytes | None, timeout: float | None,
                retry: RetryPolicy | None) -> Settings:
        if root_cert is None and os.environ.get(TLS_ROOT_CERT_ENV):
            root_cert = os.environ[TLS_ROOT_CERT_ENV]
        if isinstance(root_cert, (str, os.PathLike)):
            root_cert = Path(root_cert).read_bytes()
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout is {timeout} s; it must be positive (None: no deadline)")
        return cls(address=address,
                   api_token=api_token if api_token is not None else os.environ.get(API_TOKEN_ENV, ""),
                   admin_token=admin_token if admin_token is not None else os.environ.get(ADMIN_TOKEN_ENV, ""),
                   tls=bool(tls) or root_cert is not None, root_certificates=root_cert, timeout=timeout,
                   retry=retry or RetryPolicy())

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials (the given root certificate, else the system's roots), or None: plaintext."""
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates) if self.tls else None

    def metadata(self, admin: bool = False) -> tuple[tuple[str, str], ...]:
        """The bearer token for a call: the admin token for adapter load/unload, else the API token."""
        token = self.admin_token if admin else self.api_token
        return (("authorization", f"Bearer {token}"),) if token else ()


def retryable(error: grpc.RpcError) -> bool:
    return error.code() == grpc.StatusCode.UNAVAILABLE


def merge_sampling(sampling: SamplingParams | None, fields: dict) -> SamplingParams:
    """`sampling` (default SamplingParams()) with `fields` replaced; TypeError names an unknown field."""
    return dataclasses.replace(sampling or SamplingParams(), **fields)


class Deadline:
    """A call's deadline across its attempts: `remaining()` seconds for the next one (None: none)."""

    def __init__(self, timeout: float | None):
        self._end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())

    def allows(self, wait_s: float) -> bool:
        return self._end is None or time.monotonic() + wait_s < self._end
