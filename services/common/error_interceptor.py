"""The backstop server interceptor: domain errors become their status (with their reason, as
grpc's rich status), anything unexpected is logged and answered INTERNAL (STYLE 6)."""

from __future__ import annotations

import asyncio
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError

from services.common.errors import InvalidArgument, rich_status_of, set_status
from tessera.rich_status import ErrorInfo

log = logging.getLogger(__name__)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """The backstop: domain errors become their status; anything unexpected is logged and INTERNAL.

    Wraps all four handler kinds, so servicers never catch errors just to translate them. A
    request that is not valid protobuf (e.g. a string field with bad UTF-8) is INVALID_ARGUMENT
    rather than grpc's default UNKNOWN. A streaming handler is either an async generator or a
    coroutine that writes its responses with `context.write` (grpc's health Watch is one); each
    is wrapped in its own shape. Synchronous handlers pass through untouched.
    """

    # kind -> (handler factory, request is a stream, response is a stream)
    _KINDS = {
        "unary_unary": (grpc.unary_unary_rpc_method_handler, False, False),
        "unary_stream": (grpc.unary_stream_rpc_method_handler, False, True),
        "stream_unary": (grpc.stream_unary_rpc_method_handler, True, False),
        "stream_stream": (grpc.stream_stream_rpc_method_handler, True, True),
    }

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        for kind, (factory, streams_in, streams_out) in self._KINDS.items():
            inner = getattr(handler, kind)
            if inner is None:
                continue
            if streams_out and inspect.isasyncgenfunction(inner):
                wrap = _wrap_streaming
            elif inspect.iscoroutinefunction(inner):
                wrap = _wrap_single
            else:
                return handler
            return factory(wrap(inner, details.method, streams_in),
                           _tolerant(handler.request_deserializer), handler.response_serializer)
        return handler


class _Undecodable:
    """Stands in for a request whose bytes did not parse, so the handler can answer the status."""

    def __init__(self, error: Exception):
        self.error = error

    def check(self):
        raise InvalidArgument(f"request is not a valid protobuf message: {self.error}")


def _tolerant(deserialize):
    if deserialize is None:
        return None

    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as error:
            return _Undecodable(error)

    return parse


def _checked(request, streams_in: bool):
    if not streams_in:
        if isinstance(request, _Undecodable):
            request.check()
        return request

    async def items():
        async for item in request:
            if isinstance(item, _Undecodable):
                item.check()
            yield item

    return items()


def _wrap_single(inner, method: str, streams_in: bool):
    async def behavior(request, context):
        try:
            return await inner(_checked(request, streams_in), context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as error:  # this is the backstop
            status = _status_logged(method, error)
        del request  # see _end_with_status
        _end_with_status(context, *status)

    return behavior


def _wrap_streaming(inner, method: str, streams_in: bool):
    async def behavior(request, context):
        try:
            async for response in inner(_checked(request, streams_in), context):
                yield response
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as error:
            status = _status_logged(method, error)
        else:
            return
        del request  # see _end_with_status
        _end_with_status(context, *status)

    return behavior


def _status_logged(method: str, error: Exception) -> tuple[grpc.StatusCode, str, ErrorInfo]:
    code, message, info = rich_status_of(error)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=error)
    else:
        log.info("%s -> %s: %s", method, code.name, message)
    _drop_tracebacks(error)
    return code, message, info


def _drop_tracebacks(error: BaseException) -> None:
    """Unlink the tracebacks of `error` and of every exception it chains.

    A frame that catches an exception and raises another (`except X as e: raise Y from e`) keeps
    `e` as a local while `e`'s traceback keeps the frame: a reference cycle holding the frame's
    request until a full gc. Once the status is logged nothing needs those frames.
    """
    pending, seen = [error], set()
    while pending:
        chained = pending.pop()
        if chained is not None and id(chained) not in seen:
            seen.add(id(chained))
            chained.__traceback__ = None
            pending += [chained.__cause__, chained.__context__]


def _end_with_status(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, info: ErrorInfo) -> None:
    """End the call with `code` and its ErrorInfo `info`, keeping nothing of the request alive.

    Called after the `except` block, never inside it: the exception's traceback holds every
    servicer frame and the request, and `context.abort` would chain it to an AbortError that grpc
    keeps on the call's state in a reference cycle (a refused 50 MB request stayed in memory until
    a full gc). Setting the status instead of aborting raises nothing at all; grpc discards the
    handler's return value when the code is not OK. The caller drops its `request` first.
    """
    set_status(context, code, message, info)
