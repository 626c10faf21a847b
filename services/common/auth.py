"""Internal-hop authentication (a per-cluster shared secret) and TLS for the public port.

Every service reads the cluster's internal token once at start, from the file named by
`--internal-token-file PATH` or `$TESSERA_INTERNAL_TOKEN_FILE` (a path, never the secret itself,
so it stays out of every process's argv). With a token configured:

- the internal services (vision, decoder, pooling, adapters) refuse every call whose metadata
  `x-tessera-internal-token` does not match it with UNAUTHENTICATED, except `grpc.health.v1` and
  server reflection (kubelet and compose probes send no metadata);
- every channel a service opens to another (`services.common.server.insecure_channel`) adds that
  metadata to each call, so no call site can forget it.

The gateway's public port never asks for the internal token (its admin RPCs keep their own bearer
token in `authorization`, which it relays to the registry). A service started by hand without a
token runs with internal auth OFF; `tessera up` generates a token per cluster and turns it on.
The gateway may serve TLS (`--tls-cert-file`, `--tls-key-file`, PEM files).
"""

from __future__ import annotations

import argparse
import hmac
import os
import secrets
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.common.errors import TesseraError, Unauthenticated, rich_status_of, set_status
from services.common.interceptors import metadata_interceptors
from tessera.protocol import (
    INTERNAL_TOKEN_FILE_ENV,
    INTERNAL_TOKEN_METADATA,
    INTERNAL_TOKEN_MISSING,
    INTERNAL_TOKEN_WRONG,
)

# Values the deploy files and docs have shown in place of a secret; a service refuses to start with
# one as its internal token, admin token or API key (`refuse_placeholder`).
PLACEHOLDER_SECRETS = frozenset({"replace-me-in-an-overlay", "replace-me", "replace_me", "changeme", "change-me",
                                 "change_me", "secret", "token", "password", "example", "xxx"})

# Probes and tooling reach these without credentials; they reveal no content.
UNAUTHENTICATED_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                            "/grpc.reflection.v1.ServerReflection/")


@dataclass(frozen=True)
class Security:
    """What one service process was started with. `internal_token` None = internal auth off."""

    internal_token: str | None = field(default=None, repr=False)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for the public port, or None (plaintext)."""
        if self.tls_cert_file is None:
            return None
        pair = (self.tls_key_file.read_bytes(), self.tls_cert_file.read_bytes())
        return grpc.ssl_server_credentials([pair])


def add_arguments(parser: argparse.ArgumentParser, tls: bool = False) -> None:
    """The security flags of a service's command line (`tls`: the gateway's public port)."""
    parser.add_argument("--internal-token-file", default=None,
                        help=f"file holding the cluster's internal token (default ${INTERNAL_TOKEN_FILE_ENV}; "
                             "neither = internal auth off, as for a service started by hand)")
    if tls:
        parser.add_argument("--tls-cert-file", default=None, help="PEM certificate chain: serve TLS")
        parser.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")


def configure_security(argv: Sequence[str] | None, tls: bool = False) -> Security:
    """Read the security flags of `argv` (default sys.argv[1:]) and the token file, once, and make
    the token this process's (`use_internal_token`). Called first in every service's `main`.

    Raises:
        SystemExit: a named token file that is missing, unreadable or empty, or a TLS flag without
            its pair, a certificate and key that do not match; the message is one line.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser, tls)
    args, _ = parser.parse_known_args(argv)
    path = args.internal_token_file or os.environ.get(INTERNAL_TOKEN_FILE_ENV) or None
    token = _read_token(path) if path else None
    cert, key = getattr(args, "tls_cert_file", None), getattr(args, "tls_key_file", None)
    if bool(cert) != bool(key):
        raise SystemExit("--tls-cert-file and --tls-key-file go together; got only one")
    for flag, value in (("--tls-cert-file", cert), ("--tls-key-file", key)):
        if value and not Path(value).is_file():
            raise SystemExit(f"{flag} {value}: no such file")
    if cert:
        try:  # grpc would only say the port cannot be bound
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
        except ssl.SSLError as error:
            raise SystemExit(f"--tls-cert-file {cert} and --tls-key-file {key} are not a PEM certificate chain and "
                             f"its private key ({error.reason or error})") from None
    use_internal_token(token)
    return Security(token, Path(cert) if cert else None, Path(key) if key else None)


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as error:
        raise SystemExit(f"internal token file {path}: {error.strerror or error}") from None
    if not token:
        raise SystemExit(f"internal token file {path} is empty; refusing to start without a token")
    try:
        refuse_placeholder(f"internal token file {path}", token)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    return token


def refuse_placeholder(source: str, secret: str) -> None:
    """Raises ValueError (one line naming `source`) when `secret` is a placeholder
    (`PLACEHOLDER_SECRETS`, any case): a deploy file's stand-in that an operator never replaced."""
    if secret.strip().lower() in PLACEHOLDER_SECRETS:
        raise ValueError(f"{source} holds the placeholder {secret.strip()!r}, not a secret; write a random one "
                         "there (python3 -c \"import secrets; print(secrets.token_hex(32))\")")


_process_token: str | None = None


def use_internal_token(token: str | None) -> None:
    """Set this process's internal token: servers check it, channels send it. None = off."""
    global _process_token
    _process_token = token


def internal_token() -> str | None:
    return _process_token


def write_token_file(directory: Path) -> Path:
    """A fresh random token in `directory`/internal-token, readable by its owner only (0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "internal-token"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_urlsafe(32))
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT
    return path


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the cluster's internal token with UNAUTHENTICATED (constant-time compare).

    The refusal handler never parses the request's bytes.
    """

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith(UNAUTHENTICATED_SERVICES):
            return await continuation(details)
        presented = [value for key, value in (details.invocation_metadata or ()) if key == INTERNAL_TOKEN_METADATA]
        if not presented:
            refused = Unauthenticated(f"this is an internal port; metadata {INTERNAL_TOKEN_METADATA!r} is missing",
                                      reason=INTERNAL_TOKEN_MISSING)
        elif not hmac.compare_digest(_as_bytes(presented[0]), self._token):
            refused = Unauthenticated(f"metadata {INTERNAL_TOKEN_METADATA!r} does not match this cluster's internal "
                                      "token", reason=INTERNAL_TOKEN_WRONG)
        else:
            return await continuation(details)
        handler = await continuation(details)
        return None if handler is None else refusal_handler(handler, refused)


def _as_bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def refusal_handler(handler: grpc.RpcMethodHandler, error: TesseraError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers `error`'s status, reason included,
    without parsing the request's bytes.

    It sets the status rather than raising grpc's AbortError, which grpc keeps on the call in a
    reference cycle with the handler's frame (services/common/error_interceptor.py `_end_with_status`).
    """
    status = rich_status_of(error)

    async def refuse(request, context):
        del request  # nothing of a refused call outlives it
        set_status(context, *status)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kinds[handler.request_streaming, handler.response_streaming](refuse)


def token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """grpc.aio client interceptors that send `token` on every call of a channel."""
    entry = ((INTERNAL_TOKEN_METADATA, token),)
    return metadata_interceptors(lambda details: entry)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The interceptors every internal channel of this process carries (none when auth is off)."""
    return token_interceptors(_process_token) if _process_token else []


def server_interceptors(public: bool) -> list[grpc.aio.ServerInterceptor]:
    """The token check of an internal port (none on the public port, none when auth is off)."""
    return [] if public or not _process_token else [InternalTokenInterceptor(_process_token)]
