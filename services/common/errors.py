"""One error hierarchy for every service, mapped once to gRPC status codes.

Core code raises these (never gRPC types); `ErrorInterceptor` turns them into statuses at the
edge, and answers INTERNAL (and logs) for anything else. The mapping follows ARCHITECTURE.md:
bad input -> INVALID_ARGUMENT, unknown adapter/model -> NOT_FOUND, busy/full ->
RESOURCE_EXHAUSTED, unload of a leased adapter -> FAILED_PRECONDITION, auth ->
UNAUTHENTICATED / PERMISSION_DENIED, replica down -> UNAVAILABLE.
"""

from __future__ import annotations

import grpc


class TesseraError(Exception):
    """Base of every domain error; `code` is the gRPC status it maps to."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(TesseraError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(TesseraError, KeyError):
    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class ResourceExhausted(TesseraError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(TesseraError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(TesseraError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unauthenticated(TesseraError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(TesseraError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(TesseraError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(TesseraError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


MAX_MESSAGE_CHARS = 1024  # status messages travel in a trailer (gRPC's metadata limit is 16 KiB)


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (code, message) a client sees for `error`; the message is at most MAX_MESSAGE_CHARS.

    A `grpc.aio.AioRpcError` from a downstream service passes through unchanged, so the gateway
    relays the decoder's INVALID_ARGUMENT rather than hiding it behind INTERNAL. Messages often
    quote client input (an adapter name, a path): cut whole, a huge one would overflow the trailer
    and the client would see RESOURCE_EXHAUSTED instead of the real status.
    """
    if isinstance(error, TesseraError):
        return error.code, clip_message(str(error))
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), clip_message(error.details() or "")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}"


def clip_message(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` cut to `limit` characters, saying how many were cut."""
    if len(message) <= limit:
        return message
    cut = len(message) - limit
    return f"{message[:limit]}... ({cut} more characters)"
