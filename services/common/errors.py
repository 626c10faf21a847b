"""One error hierarchy for every service, mapped to gRPC status codes and back from one table.

Core code raises these (never gRPC types); `ErrorInterceptor` turns them into statuses at the
edge (`status_of`), and answers INTERNAL (and logs) for anything else. Clients turn a peer's
status back into the same domain error (`error_from_rpc`), so a relayed failure keeps its
meaning. The mapping follows ARCHITECTURE.md: bad input -> INVALID_ARGUMENT, unknown
adapter/model -> NOT_FOUND, busy/full -> RESOURCE_EXHAUSTED, unload of a leased adapter ->
FAILED_PRECONDITION, auth -> UNAUTHENTICATED / PERMISSION_DENIED, replica down -> UNAVAILABLE,
a peer out of time -> DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import grpc

# The trailing metadata key of a refusal that one request field is to blame for: that field's
# path in the service's protobuf request ("sampling.n", "token_ids[3]"), so each API can name it
# in its own terms (the HTTP API's `param`) without reading the message.
FIELD_METADATA = "tessera-field"


class TesseraError(Exception):
    """Base of every domain error; `code` is the gRPC status it maps to. `field`: the request field
    to blame, as a path of the protobuf request (FIELD_METADATA), or None; the message then starts
    with that path (or, below a message, its last part: "min_tokens must be ...")."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, *args, field: str | None = None):
        super().__init__(*args)
        self.field = field


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


class Internal(TesseraError):
    """A failure with no domain meaning: a peer's INTERNAL, or a status no other error stands for."""

    code = grpc.StatusCode.INTERNAL


# The one table, read both ways: each error's `code` is its status, and each status its error.
ERRORS = (InvalidArgument, NotFound, ResourceExhausted, FailedPrecondition, AlreadyExists, Unauthenticated,
          PermissionDenied, Unavailable, DeadlineExceeded, Internal)
_ERROR_OF_CODE = {error.code: error for error in ERRORS}


MAX_MESSAGE_CHARS = 1024  # status messages travel in a trailer (gRPC's metadata limit is 16 KiB)


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (code, message) a client sees for `error`; the message is at most MAX_MESSAGE_CHARS.

    A `grpc.aio.AioRpcError` from a downstream service goes through `error_from_rpc`, so the
    gateway relays the decoder's INVALID_ARGUMENT rather than hiding it behind INTERNAL. Messages
    often quote client input (an adapter name, a path): cut whole, a huge one would overflow the
    trailer and the client would see RESOURCE_EXHAUSTED instead of the real status.
    """
    if isinstance(error, grpc.aio.AioRpcError):
        error = error_from_rpc(error)
    if isinstance(error, TesseraError):
        return error.code, clip_message(str(error))
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}"


def error_of(code: grpc.StatusCode, message: str, field: str | None = None) -> TesseraError:
    """The domain error a peer's status `code` stands for, with its `message` (and `field`).

    A code no domain error stands for (CANCELLED, UNIMPLEMENTED, ...) becomes `Internal`, naming it.
    """
    error = _ERROR_OF_CODE.get(code)
    if error is None:
        return Internal(f"{code.name}: {message}")
    return error(message, field=field)


def error_from_rpc(error: grpc.aio.AioRpcError) -> TesseraError:
    """`error_of` for a failed call's status, details and FIELD_METADATA."""
    field = next((value for key, value in (error.trailing_metadata() or ()) if key == FIELD_METADATA), None)
    return error_of(error.code(), error.details() or "", field or None)


def prefixed(error: TesseraError, prefix: str) -> TesseraError:
    """`error` with its field under `prefix` (a submessage's name: "sampling"), for a check that
    names the submessage's own fields."""
    if error.field is not None:
        error.field = f"{prefix}.{error.field}"
    return error


def clip_message(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` cut to `limit` characters, saying how many were cut."""
    if len(message) <= limit:
        return message
    cut = len(message) - limit
    return f"{message[:limit]}... ({cut} more characters)"
