"""The client's exceptions: one class per gRPC status a tessera call can end with.

The public client does not import the services' code, so it keeps its own table from status to
exception; the classes mirror the services' domain errors (services/common/errors.py) by status.
Every exception carries the status `code` and the server's `details` ("prompt has 9000 tokens
after image expansion; the model's context is 8192").
"""

from __future__ import annotations

import grpc


class TesseraError(Exception):
    """A call that ended with a non-OK status. `code` is the grpc.StatusCode, `details` its message."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str = "", code: grpc.StatusCode | None = None):
        super().__init__(details)
        self.details = details
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
    cls = STATUS_TO_ERROR.get(code)
    return cls(details) if cls is not None else TesseraError(details, code)
