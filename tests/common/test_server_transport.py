"""The shared server: every handler shape through the error interceptor, health Watch, ports in use.

A small in-process server with raw-bytes methods of each shape stands in for a service: the
interceptor is what is tested, so no model is needed.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.errors import InvalidArgument, error_from_rpc
from services.common.server import bind, create_server

SERVICE = "test.Shapes"


async def unary_unary(request: bytes, context) -> bytes:
    if request == b"bad":
        raise InvalidArgument("request says bad", field="request")
    return request.upper()


async def unary_stream_gen(request: bytes, context):
    for i in range(3):
        yield request + str(i).encode()
    if request == b"bad":
        raise InvalidArgument("request says bad", field="request")


async def unary_stream_writer(request: bytes, context) -> None:
    for i in range(3):
        await context.write(request + str(i).encode())
    if request == b"bad":
        raise InvalidArgument("request says bad", field="request")


async def stream_unary(requests, context) -> bytes:
    return b"".join([item async for item in requests])


async def stream_stream_gen(requests, context):
    async for item in requests:
        if item == b"bad":
            raise InvalidArgument("request says bad", field="request")
        yield item.upper()


async def stream_stream_writer(requests, context) -> None:
    async for item in requests:
        if item == b"bad":
            raise InvalidArgument("request says bad", field="request")
        await context.write(item.upper())


HANDLERS = {
    "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary),
    "UnaryStreamGen": grpc.unary_stream_rpc_method_handler(unary_stream_gen),
    "UnaryStreamWriter": grpc.unary_stream_rpc_method_handler(unary_stream_writer),
    "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary),
    "StreamStreamGen": grpc.stream_stream_rpc_method_handler(stream_stream_gen),
    "StreamStreamWriter": grpc.stream_stream_rpc_method_handler(stream_stream_writer),
}


async def _start() -> tuple[grpc.aio.Server, health.aio.HealthServicer, str]:
    server = create_server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, HANDLERS)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, health_servicer, f"127.0.0.1:{port}"


def _run(body):
    async def main():
        server, health_servicer, address = await _start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                await body(channel, health_servicer)
        finally:
            await server.stop(0)

    asyncio.run(main())


def _method(channel, kind: str, name: str):
    return getattr(channel, kind)(f"/{SERVICE}/{name}")


async def _stream_of(*items: bytes):
    for item in items:
        yield item


def test_every_handler_shape_answers():
    async def body(channel, _):
        assert await _method(channel, "unary_unary", "UnaryUnary")(b"ab") == b"AB"
        for name in ("UnaryStreamGen", "UnaryStreamWriter"):
            got = [m async for m in _method(channel, "unary_stream", name)(b"x")]
            assert got == [b"x0", b"x1", b"x2"], name
        assert await _method(channel, "stream_unary", "StreamUnary")(_stream_of(b"a", b"b")) == b"ab"
        for name in ("StreamStreamGen", "StreamStreamWriter"):
            got = [m async for m in _method(channel, "stream_stream", name)(_stream_of(b"a", b"b"))]
            assert got == [b"A", b"B"], name

    _run(body)


@pytest.mark.parametrize("kind,name", [
    ("unary_unary", "UnaryUnary"),
    ("unary_stream", "UnaryStreamGen"),
    ("unary_stream", "UnaryStreamWriter"),
    ("stream_stream", "StreamStreamGen"),
    ("stream_stream", "StreamStreamWriter"),
])
def test_domain_errors_become_their_status_in_every_shape(kind, name):
    async def body(channel, _):
        call = _method(channel, kind, name)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if kind == "unary_unary":
                await call(b"bad")
            elif kind == "unary_stream":
                [m async for m in call(b"bad")]
            else:
                [m async for m in call(_stream_of(b"ok", b"bad"))]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "request says bad"
        relayed = error_from_rpc(info.value)  # the field to blame travels as data, for the caller to name
        assert isinstance(relayed, InvalidArgument) and relayed.field == "request"

    _run(body)


def test_health_watch_streams_status_changes():
    async def body(channel, health_servicer):
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        first = await asyncio.wait_for(watch.read(), 5)
        assert first.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        second = await asyncio.wait_for(watch.read(), 5)
        assert second.status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        unknown = stub.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"))
        reply = await asyncio.wait_for(unknown.read(), 5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()

    _run(body)


def test_a_port_in_use_is_refused_naming_it():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]

        async def main():
            server = create_server()
            with pytest.raises(OSError, match=f"port {port} is in use"):
                bind(server, "pooling", f"127.0.0.1:{port}")
            await server.stop(0)

        asyncio.run(main())


def test_a_second_grpc_server_cannot_share_a_port():
    async def main():
        first = create_server()
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        second = create_server()
        try:
            with pytest.raises(OSError, match=f"port {port} is in use"):
                bind(second, "decoder", f"127.0.0.1:{port}")
        finally:
            await second.stop(0)
            await first.stop(0)

    asyncio.run(main())
