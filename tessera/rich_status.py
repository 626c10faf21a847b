"""A refusal's reason on the wire: grpc's rich status (grpcio-status), written by the services and
read by the gateway and the client.

The trailer `grpc-status-details-bin` holds a google.rpc.Status (the call's code and message) with
one google.rpc.ErrorInfo: `domain` tessera.protocol.ERROR_DOMAIN, `reason` from
tessera.protocol's table, and `metadata` (e.g. the request field refused). Every status a tessera
service answers carries one, so a status without it was made by grpc on the caller's side (a
connection refused, a message past the caller's own limit) or by something that is not tessera.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tessera.protocol import ERROR_DOMAIN

DETAILS_METADATA = "grpc-status-details-bin"


@dataclass(frozen=True)
class ErrorInfo:
    """What a tessera refusal says about itself: its `reason` and `metadata` (string -> string)."""

    reason: str
    metadata: Mapping[str, str] = field(default_factory=dict)


def status_metadata(code: grpc.StatusCode, message: str, info: ErrorInfo) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that carries `info` for a call ending with `code` and `message` (the
    status's details, exactly as the call answers them)."""
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=info.reason, domain=ERROR_DOMAIN,
                                                          metadata=dict(info.metadata)))
    return tuple(rpc_status.to_status(status).trailing_metadata)


def error_info(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> ErrorInfo | None:
    """tessera's ErrorInfo in a call's trailing metadata, or None where it holds none (a status grpc
    made, or one from outside tessera)."""
    for key, value in trailing_metadata or ():
        if key != DETAILS_METADATA or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except Exception:  # a peer's undecodable details are no reason
            return None
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == ERROR_DOMAIN:
                return ErrorInfo(info.reason, dict(info.metadata))
    return None


def error_info_of(error: grpc.RpcError) -> ErrorInfo | None:
    """`error_info` of a failed call (`grpc.RpcError` or `grpc.aio.AioRpcError`)."""
    trailing = getattr(error, "trailing_metadata", None)
    return error_info(trailing() if callable(trailing) else None)
