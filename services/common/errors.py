"""One error hierarchy for every service, mapped to gRPC status codes and back from one table.

Core code raises these (never gRPC types); `ErrorInterceptor` turns them into statuses at the
edge (`status_of`), and answers INTERNAL (and logs) for anything else. Each carries a
machine-readable `reason` (tessera/protocol.py's table; by default its status's name) and the
request `field` it is about, both sent as the status's ErrorInfo (tessera/rich_status.py). Clients
turn a peer's status back into the same domain error (`error_from_rpc`), reason and field
included, so a relayed failure keeps its meaning. The mapping follows ARCHITECTURE.md: bad input -> INVALID_ARGUMENT, unknown
adapter/model -> NOT_FOUND, busy/full -> RESOURCE_EXHAUSTED, unload of a leased adapter ->
FAILED_PRECONDITION, auth -> UNAUTHENTICATED / PERMISSION_DENIED, replica down -> UNAVAILABLE,
a peer out of time -> DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import grpc

from tessera import protocol
from tessera.rich_status import ErrorInfo, error_info_of, status_metadata


class TesseraError(Exception):
    """Base of every domain error; `code` is the gRPC status it maps to.

    Args:
        args: the message, for people (what was wrong, the limit that applied, the value refused).
        reason: the refusal's machine-readable reason (tessera.protocol; default: the status's name).
        field: the request field to blame, as a path of the protobuf request ("sampling.n",
            "token_ids[3]"), or None; the message then starts with that path (or, below a message,
            its last part: "min_tokens must be ..."), so each API can name it in its own terms (the
            HTTP API's `param`) without reading the message.
    """

    code = grpc.StatusCode.INTERNAL

    def __init__(self, *args, reason: str | None = None, field: str | None = None) -> None:
        super().__init__(*args)
        self.reason = reason or self.code.name
        self.field = field

    def error_info(self) -> ErrorInfo:
        return ErrorInfo(self.reason, {protocol.FIELD_METADATA: self.field} if self.field else {})


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


MAX_MESSAGE_CHARS = protocol.MAX_STATUS_MESSAGE_CHARS


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (code, message) a client sees for `error` (`rich_status_of` without the ErrorInfo)."""
    code, message, _ = rich_status_of(error)
    return code, message


def rich_status_of(error: BaseException) -> tuple[grpc.StatusCode, str, ErrorInfo]:
    """The (code, message, ErrorInfo) a client sees for `error`; the message is at most MAX_MESSAGE_CHARS.

    A `grpc.aio.AioRpcError` from a downstream service goes through `error_from_rpc`, so the
    gateway relays the decoder's INVALID_ARGUMENT, and its reason, rather than hiding it behind
    INTERNAL. Messages often quote client input (an adapter name, a path): cut whole, a huge one
    would overflow the trailer and the client would see RESOURCE_EXHAUSTED instead of the real status.
    """
    domain = as_domain_error(error)
    if domain is not None:
        return domain.code, clip_message(str(domain)), domain.error_info()
    code = grpc.StatusCode.INTERNAL
    return code, f"internal error: {type(error).__name__}", ErrorInfo(code.name)


def set_status(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, info: ErrorInfo) -> None:
    """End the call with `code`, `message` and `info` (in the trailer, after what the call's
    trailing metadata holds already: its request id) without raising: `context.abort` would chain
    the exception being handled to an AbortError grpc keeps on the call (error_interceptor.py `_end_with_status`)."""
    context.set_code(code)
    context.set_details(message)
    context.set_trailing_metadata((*(context.trailing_metadata() or ()), *status_metadata(code, message, info)))


def as_domain_error(error: BaseException) -> TesseraError | None:
    """`error` as the domain error a client sees (a downstream call's failure through
    `error_from_rpc`), or None for an unexpected exception (INTERNAL)."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error_from_rpc(error)
    return error if isinstance(error, TesseraError) else None


def error_of(code: grpc.StatusCode, message: str, info: ErrorInfo | None = None) -> TesseraError:
    """The domain error a peer's status `code` stands for, with its `message` and the reason and
    field of its ErrorInfo `info` (None: the status's own name, no field).

    A code no domain error stands for (CANCELLED, UNIMPLEMENTED, ...) becomes `Internal`, naming it.
    """
    error = _ERROR_OF_CODE.get(code)
    if error is None:
        return Internal(f"{code.name}: {message}")
    if info is None:
        return error(message)
    return error(message, reason=info.reason, field=info.metadata.get(protocol.FIELD_METADATA))


def error_from_rpc(error: grpc.aio.AioRpcError) -> TesseraError:
    """`error_of` for a failed call's status, details and ErrorInfo."""
    return error_of(error.code(), error.details() or "", error_info_of(error))


def answered_by_service(error: grpc.RpcError) -> bool:
    """Whether a tessera service answered the failed call itself (its status carries tessera's
    ErrorInfo), rather than grpc on this side (connection refused or reset, a ping not acked, a
    message past this side's limit), also while the channel still says READY."""
    return error_info_of(error) is not None


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
