"""The client's exceptions: one class per gRPC status a tessera call can end with.

The public client does not import the services' code, so it keeps its own table from status to
exception; the classes mirror the services' domain errors (services/common/errors.py) by status.
Every exception carries the status `code`, the server's `details` ("prompt has 9000 tokens after
image expansion; the model's context is 8192") and, from the status's ErrorInfo, its `reason`
(tessera.protocol's table: UNKNOWN_ADAPTER, API_KEY_INVALID, ...; "" for a status no tessera
service answered, e.g. a gateway that cannot be reached) and the request `field` it is about.
"""

from __future__ import annotations

import grpc

from tessera.protocol import FIELD_METADATA
from tessera.rich_status import error_info_of


class TesseraError(Exception):
    """A call that ended with a non-OK status. `code` is the grpc.StatusCode, `details` its message,
    `reason` its machine-readable reason ("" when none came) and `field` the request field named."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str = "", code: grpc.StatusCode | None = None, *, reason: str = "",
                 field: str | None = None):
        super().__init__(details)
        self.details, self.reason, self.field = details, reason, field
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class InvalidArgument(TesseraError, ValueError):
    """The request was refused before any work: the message names the field, its size and the limit."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(TesseraError):
    """Unknown adapter or model."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TesseraError):
    """An adapter name is taken (load it with `replace=True`)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(TesseraError):
    """The cluster is full or busy, or a message is past the size limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(TesseraError):
    """E.g. unloading or replacing an adapter that requests still lease (pass `drain=True` to wait)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(TesseraError):
    """A token is missing."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(TesseraError):
    """A token is wrong."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(TesseraError):
    """The gateway, or the service it needs, cannot be reached (after the client's retries)."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(TesseraError):
    """The call's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(TesseraError):
    code = grpc.StatusCode.CANCELLED


class Internal(TesseraError):
    """An unexpected failure inside the cluster (its logs say more)."""

    code = grpc.StatusCode.INTERNAL


STATUS_TO_ERROR: dict[grpc.StatusCode, type[TesseraError]] = {
    cls.code: cls for cls in (InvalidArgument, NotFound, AlreadyExists, ResourceExhausted, FailedPrecondition,
                              Unauthenticated, PermissionDenied, Unavailable, DeadlineExceeded, Cancelled, Internal)
}


def from_rpc_error(error: grpc.RpcError) -> TesseraError:
    """The exception for a failed call (`grpc.RpcError` or `grpc.aio.AioRpcError`); unlisted codes
    become a plain TesseraError carrying the code."""
    code, details = error.code(), error.details() or ""
    info = error_info_of(error)
    reason, field = (info.reason, info.metadata.get(FIELD_METADATA)) if info is not None else ("", None)
    cls = STATUS_TO_ERROR.get(code)
    if cls is None:
        return TesseraError(details, code, reason=reason, field=field)
    return cls(details, reason=reason, field=field)
