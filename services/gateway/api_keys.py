"""API keys on the gateway's public gRPC port: the same keys (`--api-key-file`) as its HTTP API.

A call to a Gateway RPC other than LoadAdapter / UnloadAdapter (admin calls: their
`authorization` carries the registry's admin token) must send metadata `authorization: Bearer
<key>`; health and reflection stay open (probes). The HTTP API checks the same keys on its own
`Authorization` header (http/backend.py) before it calls the core.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from services.common.auth import UNAUTHENTICATED_SERVICES, refusal_handler, refuse_placeholder
from services.common.errors import Unauthenticated
from tessera.protocol import API_KEY_INVALID, API_KEY_MISSING, AUTHORIZATION_METADATA

ADMIN_METHODS = ("/tessera.v1.Gateway/LoadAdapter", "/tessera.v1.Gateway/UnloadAdapter")


def read_api_keys(path: str) -> frozenset[str]:
    """One key per line (blank lines and `#` comments skipped).

    Raises:
        ValueError: the file cannot be read, holds no key or a placeholder (`refuse_placeholder`).
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ValueError(f"api key file {path}: {error.strerror or error}") from None
    keys = frozenset(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"api key file {path} holds no key")
    for key in keys:
        refuse_placeholder(f"api key file {path}", key)
    return keys


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses Gateway calls without a valid `authorization: Bearer <key>` with UNAUTHENTICATED
    (constant-time compare; the refusal never parses the request)."""

    def __init__(self, keys: frozenset[str]) -> None:
        self._keys = [key.encode() for key in keys]

    async def intercept_service(self, continuation, details):
        if details.method.startswith(UNAUTHENTICATED_SERVICES) or details.method in ADMIN_METHODS:
            return await continuation(details)
        presented = [value for key, value in (details.invocation_metadata or ()) if key == AUTHORIZATION_METADATA]
        scheme, _, key = (presented[0] if presented else "").partition(" ")
        if isinstance(key, str) and scheme.lower() == "bearer" and key:
            candidate = key.strip().encode()
            if any(hmac.compare_digest(candidate, k) for k in self._keys):
                return await continuation(details)
            refused = Unauthenticated("the API key is not valid", reason=API_KEY_INVALID)
        else:
            refused = Unauthenticated("this gateway needs an API key: metadata 'authorization: Bearer <key>' "
                                      "(tessera.client: api_token)", reason=API_KEY_MISSING)
        handler = await continuation(details)
        return None if handler is None else refusal_handler(handler, refused)
