"""A refusal's reason travels as data (grpc's rich status, google.rpc.ErrorInfo) and every side maps
it from tessera.protocol's one table: the services' domain errors, the gateway's relay and HTTP
mapping, and the client's exceptions."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import (
    ERRORS,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    answered_by_service,
    error_from_rpc,
)
from services.common.server import create_server
from services.gateway.core import downstream_error
from services.gateway.http.errors import from_error
from tessera import protocol
from tessera.client.errors import NotFound as ClientNotFound
from tessera.client.errors import from_rpc_error
from tessera.rich_status import error_info_of


def test_the_table_names_grpc_statuses_and_every_status_a_domain_error_answers():
    codes = {code.name for code in grpc.StatusCode}
    assert set(protocol.REASON_TO_STATUS.values()) <= codes and set(protocol.STATUS_TO_HTTP) <= codes
    assert {error.code.name for error in ERRORS} - {"INTERNAL"} <= set(protocol.STATUS_TO_HTTP)
    assert protocol.http_status("RESOURCE_EXHAUSTED") == (429, "rate_limit_error")
    assert protocol.http_status("RESOURCE_EXHAUSTED", protocol.MESSAGE_TOO_LARGE) == (413, "invalid_request_error")
    assert protocol.http_status("UNIMPLEMENTED") == protocol.SERVER_ERROR


async def _refuse_lora(request, context):
    raise InvalidArgument("lora has 300 characters; the limit is 256 (--max-name-chars)",
                          reason=protocol.OVER_LIMIT, field="lora")


async def _unknown_adapter(request, context):
    raise NotFound("unknown adapter 'x'", reason=protocol.UNKNOWN_ADAPTER)


async def _busy(request, context):  # a stream that fails after its first message
    yield b"token"
    raise ResourceExhausted("8 requests are waiting")


async def _calls(errors: list) -> None:
    server = create_server()
    handlers = {"Lora": grpc.unary_unary_rpc_method_handler(_refuse_lora),
                "Adapter": grpc.unary_unary_rpc_method_handler(_unknown_adapter),
                "Busy": grpc.unary_stream_rpc_method_handler(_busy)}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Refuse", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method in ("Lora", "Adapter"):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await channel.unary_unary(f"/t.Refuse/{method}")(b"x", timeout=10)
                errors.append(caught.value)
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for message in channel.unary_stream("/t.Refuse/Busy")(b"x", timeout=10):
                    received.append(message)
            assert received == [b"token"]
            errors.append(caught.value)
    finally:
        await server.stop(0)


@pytest.fixture(scope="module")
def refusals() -> list[grpc.aio.AioRpcError]:
    errors: list[grpc.aio.AioRpcError] = []
    asyncio.run(_calls(errors))
    return errors


def test_a_refusal_carries_its_reason_and_field(refusals):
    lora, adapter, busy = refusals
    assert (lora.code(), lora.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                             "lora has 300 characters; the limit is 256 (--max-name-chars)")
    assert error_info_of(lora).reason == protocol.OVER_LIMIT and error_info_of(lora).metadata == {"field": "lora"}
    assert error_info_of(adapter).reason == protocol.UNKNOWN_ADAPTER
    assert error_info_of(busy).reason == "RESOURCE_EXHAUSTED"  # no specific reason: the status's name
    assert all(answered_by_service(error) for error in refusals)


def test_the_services_and_the_client_read_the_reason_back(refusals):
    lora, adapter, _ = refusals
    relayed = error_from_rpc(lora)
    assert isinstance(relayed, InvalidArgument) and (relayed.reason, relayed.field) == (protocol.OVER_LIMIT, "lora")
    client = from_rpc_error(adapter)
    assert isinstance(client, ClientNotFound) and client.reason == protocol.UNKNOWN_ADAPTER
    assert from_rpc_error(lora).field == "lora"


def test_the_gateway_relays_reasons_and_tells_its_own_side_from_the_services(refusals):
    _, adapter, busy = refusals
    assert downstream_error("decoder", "d:1", adapter).reason == protocol.UNKNOWN_ADAPTER
    assert from_error(downstream_error("decoder", "d:1", busy)).status == 429  # the service said busy

    class Local(grpc.aio.AioRpcError):  # a status grpc made on this side: no ErrorInfo
        def __init__(self, code: grpc.StatusCode, details: str):
            super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    too_large = downstream_error("decoder", "d:1", Local(grpc.StatusCode.RESOURCE_EXHAUSTED, "Sent message larger"))
    assert too_large.reason == protocol.MESSAGE_TOO_LARGE and from_error(too_large).status == 413
    refused = downstream_error("decoder", "d:1", Local(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert isinstance(refused, Unavailable) and str(refused).startswith("decoder service at d:1 is unavailable")
