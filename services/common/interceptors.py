"""One factory for grpc.aio client interceptors: a channel's calls pass through one function.

A grpc.aio channel files each interceptor under the first of the four call kinds (unary-unary,
unary-stream, stream-unary, stream-stream) it is an instance of, so one class implementing all four
would see one kind only: `client_interceptors` returns one interceptor per kind around the same
`intercept(continuation, details, request)`. `metadata_interceptors` is the common case, adding
entries to every call's metadata (the internal token, the request id).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import grpc

# (continuation, call details, request or request iterator) -> the call
Intercept = Callable[[Callable, grpc.aio.ClientCallDetails, object], Awaitable[object]]


class _Interceptor:
    def __init__(self, intercept: Intercept) -> None:
        self._intercept = intercept


class _UnaryUnary(_Interceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await self._intercept(continuation, details, request)


class _UnaryStream(_Interceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await self._intercept(continuation, details, request)


class _StreamUnary(_Interceptor, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await self._intercept(continuation, details, request_iterator)


class _StreamStream(_Interceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await self._intercept(continuation, details, request_iterator)


def client_interceptors(intercept: Intercept) -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call kind, each running `intercept` around the call."""
    return [kind(intercept) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def with_metadata(details: grpc.aio.ClientCallDetails, entries: Sequence[tuple[str, str]]) -> grpc.aio.ClientCallDetails:
    """`details` with `entries` appended to its metadata."""
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *entries)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


def metadata_interceptors(
        entries: Callable[[grpc.aio.ClientCallDetails], Sequence[tuple[str, str]]]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding `entries(details)` to every call's metadata (nothing when it is empty)."""
    async def intercept(continuation, details, request):
        extra = entries(details)
        return await continuation(with_metadata(details, extra) if extra else details, request)

    return client_interceptors(intercept)
