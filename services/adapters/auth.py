"""Admin auth for mutating registry RPCs, as a server interceptor (STYLE 7).

A registry without an admin token leaves LoadAdapter / UnloadAdapter open (development), except
to calls a gateway with API keys relays (metadata `x-tessera-api-keys: on`): those are refused
PERMISSION_DENIED (ADMIN_TOKEN_UNSET), so a cluster that asks its clients for keys never lets an
anonymous one change its adapters.
"""

from __future__ import annotations

import hmac

import grpc

from services.common.auth import refusal_handler
from services.common.errors import PermissionDenied, TesseraError, Unauthenticated
from tessera.protocol import (
    ADMIN_TOKEN_ENV,
    ADMIN_TOKEN_INVALID,
    ADMIN_TOKEN_MISSING,
    ADMIN_TOKEN_UNSET,
    API_KEYS_METADATA,
    AUTHORIZATION_METADATA,
)

ADMIN_METHODS = frozenset({"/tessera.v1.Adapters/LoadAdapter", "/tessera.v1.Adapters/UnloadAdapter"})


def check_bearer(metadata: tuple | None, token: str) -> None:
    """Check `authorization: Bearer <token>` in invocation metadata.

    Raises:
        Unauthenticated: no authorization header, or not a Bearer credential.
        PermissionDenied: a Bearer token that is not the admin token.
    """
    values = [value for key, value in (metadata or ()) if key.lower() == AUTHORIZATION_METADATA]
    if not values:
        raise Unauthenticated("this RPC is an admin operation; send metadata 'authorization: Bearer <token>'",
                              reason=ADMIN_TOKEN_MISSING)
    scheme, _, presented = str(values[0]).partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise Unauthenticated("authorization metadata must be 'Bearer <token>'", reason=ADMIN_TOKEN_MISSING)
    if not hmac.compare_digest(presented.strip().encode(), token.encode()):
        raise PermissionDenied("admin token is not valid for this registry", reason=ADMIN_TOKEN_INVALID)


def check_open(metadata: tuple | None) -> None:
    """An admin call to a registry without an admin token: open, unless a gateway with API keys relays it.

    Raises:
        PermissionDenied: metadata `x-tessera-api-keys` is present (reason ADMIN_TOKEN_UNSET).
    """
    if any(key.lower() == API_KEYS_METADATA for key, _ in (metadata or ())):
        raise PermissionDenied("the gateway has API keys but the adapter registry has no admin token: adapter "
                               f"load/unload are refused rather than open to anyone; start the registry with "
                               f"--admin-token-file PATH or ${ADMIN_TOKEN_ENV}", reason=ADMIN_TOKEN_UNSET)


class AdminAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses LoadAdapter/UnloadAdapter without the admin bearer token (with no token: only those a
    keyed gateway relays, `check_open`); other RPCs pass."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(self, continuation, details):
        if details.method not in ADMIN_METHODS:
            return await continuation(details)
        try:
            if self._token:
                check_bearer(details.invocation_metadata, self._token)
            else:
                check_open(details.invocation_metadata)
        except TesseraError as error:
            handler = await continuation(details)
            return None if handler is None else refusal_handler(handler, error)
        return await continuation(details)
