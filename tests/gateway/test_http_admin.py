"""The HTTP adapter routes over the real gateway core, in front of a registry with an admin token:
the `Authorization` header reaches the registry as the gRPC API's `authorization` metadata does,
so a call without one is 401 (UNAUTHENTICATED), a wrong token 403 (PERMISSION_DENIED), with API
keys on as off. Real sockets to the registry; the decoder and pooler addresses hold nothing."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from services.adapters.auth import AdminAuthInterceptor
from services.common.errors import PermissionDenied, Unauthenticated
from services.gateway.config import GatewayConfig
from services.gateway.core import Call, GatewayCore
from services.gateway.http.app import create_app
from services.gateway.http.backend import Backend
from tessera.v1 import adapters_pb2, adapters_pb2_grpc

ADMIN_TOKEN = "admin-secret"
NOTHING = "127.0.0.1:1"


class Registry(adapters_pb2_grpc.AdaptersServicer):
    async def UnloadAdapter(self, request, context):
        return adapters_pb2.UnloadAdapterResponse(name=request.name)


async def _post(app, path: str, body: dict, authorization: str | None) -> tuple[int, dict]:
    sent = []
    headers = [(b"content-type", b"application/json")]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b"",
             "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "server": ("test", 80),
             "client": ("test", 1), "root_path": ""}
    await app(scope, receive, send)
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


@pytest.mark.parametrize("api_keys", [frozenset(), frozenset({"key-a"})])
def test_admin_routes_answer_the_registrys_verdict_on_the_callers_own_credentials(api_keys):
    async def scenario():
        server = grpc.aio.server(interceptors=[AdminAuthInterceptor(ADMIN_TOKEN)])
        adapters_pb2_grpc.add_AdaptersServicer_to_server(Registry(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        core = GatewayCore(GatewayConfig(address="127.0.0.1:1", decoder=NOTHING, pooling=NOTHING,
                                         adapters=f"127.0.0.1:{port}", vision=""))
        app = create_app(Backend(core, {}, api_keys), max_body_bytes=1 << 20)
        body = {"lora_name": "a"}
        try:
            answers = [await _post(app, "/v1/unload_lora_adapter", body, authorization)
                       for authorization in (None, "Bearer wrong", f"Bearer {ADMIN_TOKEN}")]
            with pytest.raises(Unauthenticated):  # the gRPC servicer's path: no authorization metadata
                await core.unload_adapter(adapters_pb2.UnloadAdapterRequest(name="a"), Call())
            with pytest.raises(PermissionDenied):
                await core.unload_adapter(adapters_pb2.UnloadAdapterRequest(name="a"), Call(authorization="Bearer x"))
            return answers
        finally:
            await core.close()
            await server.stop(None)

    (missing, missing_answer), (wrong, wrong_answer), (right, right_answer) = asyncio.run(scenario())
    assert missing == 401 and missing_answer["error"]["type"] == "authentication_error", missing_answer
    assert wrong == 403 and wrong_answer["error"]["type"] == "permission_error", wrong_answer
    assert right == 200 and right_answer["id"] == "a", right_answer


@pytest.mark.parametrize("keyed", [False, True])
def test_a_keyed_gateway_never_relays_an_anonymous_admin_call_to_a_registry_without_a_token(tmp_path, keyed):
    """A registry without an admin token (development) is open, except to what a gateway with API
    keys relays: that is refused PERMISSION_DENIED (403) naming the missing token, whatever was sent."""
    keys = tmp_path / "keys"
    keys.write_text("key-a\n")

    async def scenario():
        server = grpc.aio.server(interceptors=[AdminAuthInterceptor("")])
        adapters_pb2_grpc.add_AdaptersServicer_to_server(Registry(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        core = GatewayCore(GatewayConfig(address="127.0.0.1:1", decoder=NOTHING, pooling=NOTHING,
                                         adapters=f"127.0.0.1:{port}", vision="",
                                         api_key_file=str(keys) if keyed else ""))
        app = create_app(Backend(core, {}, frozenset({"key-a"}) if keyed else frozenset()), max_body_bytes=1 << 20)
        try:
            answers = [await _post(app, "/v1/unload_lora_adapter", {"lora_name": "a"}, authorization)
                       for authorization in (None, "Bearer key-a", "Bearer anything")]
            try:
                await core.unload_adapter(adapters_pb2.UnloadAdapterRequest(name="a"), Call())
                grpc_answer = None
            except PermissionDenied as error:
                grpc_answer = error
            return answers, grpc_answer
        finally:
            await core.close()
            await server.stop(None)

    answers, grpc_answer = asyncio.run(scenario())
    if not keyed:
        assert [status for status, _ in answers] == [200, 200, 200] and grpc_answer is None
        return
    for status, answer in answers:
        assert status == 403 and answer["error"]["type"] == "permission_error", answer
        assert answer["error"]["message"].startswith("the gateway has API keys but the adapter registry has no "
                                                     "admin token: adapter load/unload are refused"), answer
    assert isinstance(grpc_answer, PermissionDenied) and grpc_answer.reason == "ADMIN_TOKEN_UNSET"
