"""Admin auth for mutating registry RPCs, as a server interceptor (STYLE 7)."""

from __future__ import annotations

import hmac

import grpc

from services.common.auth import refusal_handler
from services.common.errors import PermissionDenied, TesseraError, Unauthenticated
from tessera.protocol import ADMIN_TOKEN_INVALID, ADMIN_TOKEN_MISSING, AUTHORIZATION_METADATA

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


class AdminAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses LoadAdapter/UnloadAdapter without the admin bearer token; other RPCs pass."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(self, continuation, details):
        if details.method not in ADMIN_METHODS or not self._token:
            return await continuation(details)
        try:
            check_bearer(details.invocation_metadata, self._token)
        except TesseraError as error:
            handler = await continuation(details)
            return None if handler is None else refusal_handler(handler, error)
        return await continuation(details)
