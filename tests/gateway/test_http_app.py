"""The HTTP app's refusals, in process (ASGI calls, no sockets): each answers OpenAI's error object
with its documented status before the core is called, and a core whose services do not answer is a
503, never a 500. The routes' answers against a running cluster: tests/e2e/test_http_*.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.errors import NotFound, Unavailable
from services.common.limits import check_chars
from services.gateway.api_keys import read_api_keys
from services.gateway.http.app import create_app
from services.gateway.http.backend import Backend
from tessera import protocol
from tessera.v1 import adapters_pb2, decoder_pb2, gateway_pb2


class UnreachableCore:
    """A gateway core none of whose services answers: every call is Unavailable, as the real core's
    when no replica is ready."""

    async def _down(self, *args):
        raise Unavailable("no decoder replica is ready behind 127.0.0.1:1 (replicas: 127.0.0.1:1 TRANSIENT_FAILURE)")

    info = embed = rerank = tokenize = detokenize = load_adapter = unload_adapter = list_adapters = _down

    async def generate(self, request, call):
        await self._down()
        yield decoder_pb2.GenerateResponse()


class App:
    """The app over an UnreachableCore, and the one event loop it runs on."""

    def __init__(self, api_keys: frozenset[str] = frozenset(), **limits):
        self.loop = asyncio.new_event_loop()
        self.asgi = create_app(Backend(UnreachableCore(), {}, api_keys), **{"max_body_bytes": 4096, **limits})

    def close(self) -> None:
        self.loop.close()


def call(app: App, path: str, body: bytes | None, headers: dict[str, str] = (), chunks: int = 1) -> tuple[int, dict]:
    """POST `body` (GET when None) in `chunks` pieces; (status, JSON answer)."""
    raw = [(k.lower().encode(), v.encode()) for k, v in dict(headers).items()]
    if body is not None:
        raw.append((b"content-type", b"application/json"))
    size = max(1, len(body or b"") // chunks + 1)
    pieces = [(body or b"")[i:i + size] for i in range(0, len(body or b""), size)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET" if body is None else "POST", "path": path, "headers": raw,
             "query_string": b"", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
             "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    app.loop.run_until_complete(app.asgi(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


@pytest.fixture
def app():
    app = App()
    yield app
    app.close()


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def error_of(answer: dict) -> dict:
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    return answer["error"]


def test_remote_image_url_is_refused_naming_the_rule(app):
    image = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
    status, answer = call(app, "/v1/chat/completions", chat(messages=[{"role": "user", "content": [image]}]))
    assert status == 400 and "base64 data URI" in error_of(answer)["message"]
    assert error_of(answer)["param"] == "messages.0.content.0.image_url"


@pytest.mark.parametrize("fields, param", [({"temperature": 2.5}, "temperature"), ({"n": 0}, "n"),
                                           ({"max_tokens": 2**31}, "max_tokens"), ({"top_logprobs": 21}, "top_logprobs")])
def test_bad_parameters_are_400_naming_them(app, fields, param):
    status, answer = call(app, "/v1/chat/completions", chat(**fields))
    assert status == 400 and error_of(answer)["param"] == param


@pytest.mark.parametrize("param", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
def test_a_nan_sampling_value_is_400_saying_it_is_not_finite(app, param):
    body = chat().replace(b'"model"', f'"{param}": NaN, "model"'.encode(), 1)  # Python's json reads NaN
    status, answer = call(app, "/v1/chat/completions", body)
    assert status == 400 and error_of(answer)["param"] == param and "finite" in error_of(answer)["message"], answer


@pytest.mark.parametrize("model, body", [
    ("CompletionRequest", {"model": "m", "prompt": [0.5] * 100_000}),
    ("CompletionRequest", {"model": "m", "prompt": [[1, 2]] + [[0.5]] * 100_000}),
    ("ChatCompletionRequest", {"model": "m", "messages": [{}] * 100_000}),
    ("ChatCompletionRequest", {"model": "m", "messages": [{"role": "user", "content": [{}] * 100_000}]}),
    ("ChatCompletionRequest", {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [1] * 100_000}),
    ("EmbeddingRequest", {"model": "m", "input": [0.5] * 100_000}),
    ("RerankRequest", {"model": "m", "query": "q", "documents": [1] * 100_000}),
    ("TokenizeRequest", {"messages": [{}] * 100_000}),
    ("DetokenizeRequest", {"tokens": [0.5] * 100_000})])
def test_a_body_of_many_bad_list_items_stops_at_the_first(model, body):
    """A few errors per union branch, not one per item: 4 M bad items (a 16 MiB body) had built
    gigabytes of errors in the gateway's event loop, long enough for its supervisor to restart it."""
    from pydantic import ValidationError

    from services.gateway.http.chat import protocol as chat
    from services.gateway.http.pooling import protocol as pooling
    from services.gateway.http.tokenize import protocol as tokenize

    family = next(f for f in (chat, pooling, tokenize) if hasattr(f, model))
    with pytest.raises(ValidationError) as error:
        getattr(family, model).model_validate(body)
    assert error.value.error_count() <= 8, error.value.error_count()  # a few per union branch


def test_adapter_flags_take_json_booleans_only(app):
    for field, route, fields in (("replace", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "p"}),
                                 ("drain", "/v1/unload_lora_adapter", {"lora_name": "a"})):
        for value in ("yes", 1, "true"):
            status, answer = call(app, route, json.dumps({**fields, field: value}).encode())
            assert status == 400 and error_of(answer)["param"] == field, (field, value, answer)


def test_token_ids_past_int32_are_refused(app):
    status, answer = call(app, "/v1/completions", json.dumps({"model": "m", "prompt": [1, 2**31]}).encode())
    assert status == 400 and error_of(answer)["param"].startswith("prompt")


@pytest.mark.parametrize("fields, param", [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"tools": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"), ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"top_logprobs": 5}, "top_logprobs"), ({"stream_options": {"include_usage": True}}, "stream_options")])
def test_openai_fields_tessera_does_not_honour_are_refused_not_ignored(app, fields, param):
    status, answer = call(app, "/v1/chat/completions", chat(**fields))
    assert status == 400 and error_of(answer)["param"] == param, answer
    # the harmless values pass these checks (and reach the unreachable gateway: 503)
    harmless = {"modalities": ["text"], "tools": [], "tool_choice": "none", "functions": [],
                "function_call": "none", "top_logprobs": 0, "stream_options": None}
    assert call(app, "/v1/chat/completions", chat(**{param: harmless[param]}))[0] == 503


def test_a_developer_message_is_sent_as_the_system_message():
    from services.gateway.http.chat.protocol import ChatCompletionRequest
    from services.gateway.http.chat.serving import chat_request

    body = ChatCompletionRequest(model="m", messages=[{"role": "developer", "content": "be brief"},
                                                      {"role": "user", "content": "hi"}])
    assert [m.role for m in chat_request(body).messages] == ["system", "user"]


def test_best_of_other_than_n_is_refused(app):
    status, answer = call(app, "/v1/completions", json.dumps({"model": "m", "prompt": "x", "best_of": 3}).encode())
    assert status == 400 and error_of(answer)["param"] == "best_of"
    assert call(app, "/v1/completions", json.dumps({"model": "m", "prompt": "x", "best_of": 2, "n": 2}).encode())[0] == 503


def test_malformed_json_unknown_route_and_method(app):
    assert call(app, "/v1/embeddings", b"{not json")[0] == 400
    status, answer = call(app, "/v1/nothing", None)
    assert status == 404 and error_of(answer)["type"] == "not_found_error"
    assert call(app, "/v1/chat/completions", None)[0] == 405


def test_bodies_past_the_limit_are_413_announced_or_chunked(app):
    big = chat(messages=[{"role": "user", "content": "x" * 5000}])
    status, answer = call(app, "/v1/chat/completions", big, {"Content-Length": str(len(big))})
    assert status == 413 and "4096" in error_of(answer)["message"]
    status, answer = call(app, "/v1/chat/completions", big, chunks=4)  # no Content-Length: counted as read
    assert status == 413


def test_text_routes_have_their_own_smaller_byte_limit():
    app = App(max_body_bytes=1 << 20, max_text_body_bytes=4096)
    try:
        text = json.dumps({"model": "m", "input": "x" * 5000}).encode()
        status, answer = call(app, "/v1/embeddings", text, {"Content-Length": str(len(text))})
        assert status == 413 and "the limit is 4096 for /v1/embeddings" in error_of(answer)["message"]
        assert call(app, "/v1/completions", json.dumps({"model": "m", "prompt": "x" * 5000}).encode(), chunks=3)[0] == 413
        # chat may carry images: the same size passes its limit (and meets the unreachable gateway)
        assert call(app, "/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * 5000}]))[0] == 503
    finally:
        app.close()


def test_a_body_of_more_json_values_than_any_request_needs_is_413_before_parsing():
    from services.gateway.http.body_limit import MAX_JSON_VALUES

    app = App(max_body_bytes=1 << 30)
    try:
        ids = b"[" + b"7," * MAX_JSON_VALUES + b"7]"  # one value past the limit, 8 MB
        status, answer = call(app, "/v1/completions", b'{"model": "m", "prompt": ' + ids + b"}", chunks=8)
        assert status == 413 and f"more than {MAX_JSON_VALUES} JSON values" in error_of(answer)["message"]
        legit = json.dumps({"model": "m", "prompt": [[7] * 2048] * 64}).encode()  # 64 prompts of 2048 ids
        assert call(app, "/v1/completions", legit, chunks=4)[0] == 503
    finally:
        app.close()


def test_a_gateway_that_does_not_answer_is_503(app):
    status, answer = call(app, "/v1/embeddings", json.dumps({"model": "m", "input": "x"}).encode())
    assert status == 503 and error_of(answer)["type"] == "service_unavailable"


def test_api_keys(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\n\nkey-a\n")
    app = App(read_api_keys(str(keys)))
    body = json.dumps({"model": "m", "input": "x"}).encode()
    assert call(app, "/v1/embeddings", body)[0] == 401
    assert call(app, "/v1/embeddings", body, {"Authorization": "Bearer key-b"})[0] == 401
    assert call(app, "/v1/embeddings", body, {"Authorization": "Bearer key-a"})[0] == 503  # past auth: no gateway
    app.close()
    (tmp_path / "empty").write_text("# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_api_keys(str(tmp_path / "empty"))


def test_openapi_document_lists_every_route(app):
    status, document = call(app, "/openapi.json", None)
    assert status == 200
    assert set(document["paths"]) >= {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank",
                                      "/rerank", "/tokenize", "/v1/models", "/v1/load_lora_adapter",
                                      "/v1/unload_lora_adapter", "/health", "/embed", "/", "/info",
                                      "/score", "/v1/score", "/ping", "/version"}
    operations = [op for item in document["paths"].values() for op in item.values()]
    assert all("422" not in op["responses"] for op in operations)  # invalid bodies answer 400
    assert all("400" in op["responses"] for op in operations if "requestBody" in op)
    assert "HTTPValidationError" not in document["components"]["schemas"]


def tei_error_of(answer: dict) -> dict:
    assert set(answer) == {"error", "error_type"} and isinstance(answer["error"], str), answer
    return answer


def test_tei_routes_refuse_in_teis_error_shape(app):
    status, answer = call(app, "/embed", json.dumps({"inputs": "x", "truncate": "yes"}).encode())
    assert status == 400 and tei_error_of(answer)["error_type"] == "validation" and "truncate" in answer["error"]
    status, answer = call(app, "/", json.dumps({"inputs": [1, "mixed"]}).encode())
    assert status == 400 and tei_error_of(answer)["error_type"] == "validation"
    status, answer = call(app, "/embed", json.dumps({"inputs": "x" * 5000}).encode())
    assert status == 413 and tei_error_of(answer)["error_type"] == "validation"
    for path, body in (("/embed", {"inputs": "x"}), ("/", {"inputs": ["x"]}), ("/info", None),
                       ("/rerank", {"query": "q", "texts": ["a"]})):
        status, answer = call(app, path, None if body is None else json.dumps(body).encode())
        assert status == 503 and tei_error_of(answer)["error_type"] == "unhealthy", path  # no gateway behind it
    # /rerank with Jina's body keeps OpenAI's shape; TEI's field on /v1/rerank, or both fields, are refused
    status, answer = call(app, "/rerank", json.dumps({"query": "q", "documents": ["a"]}).encode())
    assert status == 503 and error_of(answer)["type"] == "service_unavailable"
    status, answer = call(app, "/v1/rerank", json.dumps({"query": "q", "texts": ["a"]}).encode())
    assert status == 400 and error_of(answer)["param"] == "texts" and "POST /rerank" in error_of(answer)["message"]
    status, answer = call(app, "/rerank", json.dumps({"query": "q", "texts": ["a"], "documents": ["a"]}).encode())
    assert status == 400 and "exactly one of documents" in tei_error_of(answer)["error"]  # texts sent: TEI's shape
    status, answer = call(app, "/rerank", json.dumps({"query": "q"}).encode())
    assert status == 400 and error_of(answer)["param"] == "documents"
    # a TEI body that does not validate is refused in TEI's shape too; TEI's fields take no lax types
    for body in ({"query": "q", "texts": [1, 2]}, {"query": "q", "texts": ["a"], "raw_scores": "1"},
                 {"query": "q", "texts": ["a"], "return_text": "yes"}, {"texts": ["a"]}):
        status, answer = call(app, "/rerank", json.dumps(body).encode())
        assert status == 400 and tei_error_of(answer)["error_type"] == "validation", body
    for body in ({"inputs": "x", "normalize": "no"}, {"inputs": "x", "normalize": 0}, {"inputs": [True]},
                 {"inputs": [[1, True]]}, {"inputs": "x", "dimensions": True}, {"inputs": "x", "dimensions": 2.0}):
        status, answer = call(app, "/embed", json.dumps(body).encode())
        assert status == 400 and tei_error_of(answer)["error_type"] == "validation", body


def test_vllms_truncate_prompt_tokens_is_refused_unless_honoured(app):
    status, answer = call(app, "/v1/chat/completions", chat(truncate_prompt_tokens=5))
    assert status == 400 and error_of(answer)["param"] == "truncate_prompt_tokens"
    assert "not supported" in error_of(answer)["message"]
    for path, body in (("/v1/embeddings", {"input": "x"}), ("/v1/score", {"text_1": "q", "text_2": ["d"]}),
                       ("/v1/rerank", {"query": "q", "documents": ["d"]})):
        status, answer = call(app, path, json.dumps({**body, "truncate_prompt_tokens": 5}).encode())
        assert status == 400 and error_of(answer)["param"] == "truncate_prompt_tokens", path
        assert "-1 (cut an input to the model's maximum input length" in error_of(answer)["message"]
        status, _ = call(app, path, json.dumps({**body, "truncate_prompt_tokens": -1}).encode())
        assert status == 503, path  # honoured: on to the (unreachable) gateway


def test_a_body_that_is_not_json_says_so(app):
    status, answer = call(app, "/v1/embeddings", b'{"input": "x",')
    assert status == 400 and error_of(answer)["message"].startswith("the request body is not valid JSON: ")
    assert "at byte 14" in error_of(answer)["message"]
    status, answer = call(app, "/embed", b"{bad")
    assert status == 400 and tei_error_of(answer)["error"].startswith("the request body is not valid JSON")


def test_health_answers_on_vllms_and_teis_paths_and_version(app):
    from tessera import package_version

    for path in ("/health", "/ping", "/"):  # the gateway behind is unreachable: the same 503 on each
        status, answer = call(app, path, None)
        assert status == 503 and answer["status"] == "unavailable" and answer["not_serving"], path
    assert call(app, "/version", None) == (200, {"version": package_version()})


def test_text_that_is_not_unicode_is_400_not_500(app):
    """JSON may carry a lone UTF-16 surrogate; protobuf strings cannot: 400 in OpenAI's shape."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800"}]}'
    status, answer = call(app, "/v1/chat/completions", body)
    assert status == 400 and "surrogate" in error_of(answer)["message"]
    status, answer = call(app, "/v1/embeddings", b'{"model": "m", "input": "\\udfff"}')
    assert status == 400 and error_of(answer)["type"] == "invalid_request_error"


def test_too_many_prompts_in_one_completions_call(app):
    status, answer = call(app, "/v1/completions", json.dumps({"model": "m", "prompt": ["a"] * 65}).encode())
    assert status == 400 and error_of(answer)["param"] == "prompt" and "64" in error_of(answer)["message"]


def test_extra_routes_answer_at_their_exact_path():
    """/metrics itself answers 200 (no redirect to /metrics/), as scrape configs name it."""
    from prometheus_client import CollectorRegistry, Counter, make_asgi_app

    registry = CollectorRegistry()
    Counter("probe", "a counter", registry=registry).inc()
    loop = asyncio.new_event_loop()
    try:
        asgi = loop.run_until_complete(_build_with_metrics(make_asgi_app(registry)))
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": "/metrics", "headers": [], "query_string": b"",
                 "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "server": ("test", 80),
                 "client": ("test", 1), "root_path": ""}
        loop.run_until_complete(asgi(scope, receive, send))
    finally:
        loop.close()
    assert sent[0]["status"] == 200
    assert b"probe_total 1.0" in b"".join(m.get("body", b"") for m in sent[1:])


async def _build_with_metrics(metrics_app):
    return create_app(Backend(UnreachableCore(), {}), max_body_bytes=4096, extra_routes={"/metrics": metrics_app})


def _serve(core):
    """The HTTP app over `core`."""
    return create_app(Backend(core, {}), max_body_bytes=1 << 20)


class QueuedGateway:
    """A gateway core whose Generate calls stay queued (no first message) until cancelled."""

    def __init__(self) -> None:
        self.started, self.cancelled = 0, 0

    async def info(self, call):
        return gateway_pb2.ClusterInfo(decoder=decoder_pb2.DecoderInfo(model="base"))

    async def generate(self, request, call):
        self.started += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        yield decoder_pb2.GenerateResponse()


def test_prompts_are_queued_together_and_a_client_that_leaves_cancels_every_one():
    """A completions call's prompts reach the gateway at once (not each after the previous one's first
    token), and a client gone while they wait in the queue cancels all of them: 499, nothing left."""

    async def scenario():
        servicer = QueuedGateway()
        app = _serve(servicer)
        body = json.dumps({"model": "base", "prompt": ["a", "b", "c"], "max_tokens": 4}).encode()
        gone, sent, unread = asyncio.Event(), [], [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():  # the body once, then nothing until the client leaves
            if unread:
                return unread.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"content-type", b"application/json")], "query_string": b"",
                 "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "server": ("test", 80),
                 "client": ("test", 1), "root_path": ""}
        answer = asyncio.ensure_future(app(scope, receive, send))
        for _ in range(200):
            if servicer.started == 3:
                break
            await asyncio.sleep(0.02)
        assert servicer.started == 3, servicer.started  # all three queued while none has a first message
        gone.set()
        await asyncio.wait_for(answer, 5)
        assert sent[0]["status"] == 499
        for _ in range(200):
            if servicer.cancelled == 3:
                break
            await asyncio.sleep(0.02)
        assert servicer.cancelled == 3

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()


async def _post(asgi, path: str, body: bytes | None) -> tuple[int, dict]:
    """POST `body` (GET when None) to the app on the running loop; (status, JSON answer)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": body or b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET" if body is None else "POST", "path": path, "headers": [(b"content-type", b"application/json")],
             "query_string": b"", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
             "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    await asgi(scope, receive, send)
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


class RefusingGateway:
    """Generate refuses an adapter name as the real core and decoder do."""

    async def info(self, call):
        return gateway_pb2.ClusterInfo(decoder=decoder_pb2.DecoderInfo(model="base"))

    async def generate(self, request, call):
        check_chars("lora", request.lora, 256, "max_name_chars")
        raise NotFound(f"unknown adapter {request.lora!r}", reason=protocol.UNKNOWN_ADAPTER)
        yield decoder_pb2.GenerateResponse()


def test_an_unknown_or_oversized_adapter_name_is_reported_as_the_model_field():
    async def scenario():
        app = _serve(RefusingGateway())
        return [await _post(app, "/v1/chat/completions", chat(model=model)) for model in ("gpt-4", "x" * 300)]

    loop = asyncio.new_event_loop()
    try:
        (status, unknown), (status_long, long) = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert status == 404 and error_of(unknown)["param"] == "model"
    assert error_of(unknown)["message"].startswith("model 'gpt-4' is neither the decoder's model nor a loaded adapter")
    assert status_long == 400 and error_of(long)["param"] == "model"
    assert error_of(long)["message"] == "model has 300 characters; the limit is 256 (--max-name-chars)"


class RecordingGateway:
    """Answers the adapter calls, keeping each request as it arrived."""

    def __init__(self) -> None:
        self.received = []

    async def info(self, call):
        return gateway_pb2.ClusterInfo(decoder=decoder_pb2.DecoderInfo(model="base", max_model_len=2048))

    async def load_adapter(self, request, call):
        self.received.append(request)
        return adapters_pb2.AdapterInfo(name=request.name, path=request.path)

    async def unload_adapter(self, request, call):
        self.received.append(request)
        return adapters_pb2.UnloadAdapterResponse(name=request.name)

    async def list_adapters(self, request, call):
        return adapters_pb2.ListAdaptersResponse(adapters=[adapters_pb2.AdapterInfo(name="qv", path="qv-dir",
                                                                                    state="ready")])


def test_adapter_routes_pass_replace_and_drain_and_a_model_is_retrieved_by_name():
    """The registry's refusals of a leased adapter say 'pass drain=true' / 'replace=true': the HTTP
    bodies carry both."""
    async def scenario():
        servicer = RecordingGateway()
        app = _serve(servicer)
        statuses = [
            (await _post(app, "/v1/load_lora_adapter", json.dumps(
                {"lora_name": "a", "lora_path": "p", "replace": True, "drain": True}).encode()))[0],
            (await _post(app, "/v1/unload_lora_adapter", json.dumps({"lora_name": "a", "drain": True}).encode()))[0],
            (await _post(app, "/v1/unload_lora_adapter", json.dumps({"lora_name": "a"}).encode()))[0]]
        retrieved = [await _post(app, f"/v1/models/{name}", None) for name in ("base", "qv", "nope")]
        return statuses, servicer.received, retrieved

    loop = asyncio.new_event_loop()
    try:
        statuses, (load, unload, plain), retrieved = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert statuses == [200, 200, 200]
    assert (load.name, load.path, load.replace, load.drain) == ("a", "p", True, True)
    assert (unload.name, unload.drain, plain.drain) == ("a", True, False)
    # GET /v1/models/{model} (the SDK's models.retrieve): the base model, an adapter, 404 for others
    (base_status, base), (qv_status, qv), (nope_status, nope) = retrieved
    assert (base_status, base["id"], qv_status, qv["id"], qv["parent"]) == (200, "base", 200, "qv", "base")
    assert qv["max_model_len"] == base["max_model_len"] == 2048 and base["created"] > 1_700_000_000
    assert nope_status == 404 and error_of(nope)["param"] == "model"


def _answer_to_a_slow_body(app: App, receive) -> tuple[int, dict]:
    """POST to /v1/embeddings announcing 1000 bytes, the body's pieces coming from `receive`."""
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/embeddings",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
             "query_string": b"", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
             "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    try:
        app.loop.run_until_complete(asyncio.wait_for(app.asgi(scope, receive, send), 10))
    finally:
        app.close()
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_a_body_that_stalls_is_408_and_the_connection_is_let_go():
    """A client that announces a body and stops sending (slowloris) is answered, not held."""
    pieces = [{"type": "http.request", "body": b'{"model": "m", ', "more_body": True}]

    async def receive():  # one piece, then nothing
        if pieces:
            return pieces.pop()
        await asyncio.sleep(3600)

    status, answer = _answer_to_a_slow_body(App(body_read_timeout_s=0.2), receive)
    assert status == 408 and "stalled: no bytes for 0.2 s after 15 bytes" in error_of(answer)["message"]


def test_a_body_dripped_a_byte_at_a_time_is_408_at_the_total_limit():
    async def receive():  # a byte every 0.05 s: never stalls 0.2 s, never ends
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b" ", "more_body": True}

    status, answer = _answer_to_a_slow_body(App(body_read_timeout_s=0.2, body_total_timeout_s=0.5), receive)
    assert status == 408 and "it took longer than 0.5 s" in error_of(answer)["message"]


@pytest.mark.parametrize("field, value", [("truncate", "yes"), ("truncate", 1), ("truncate", "true"),
                                          ("truncation_direction", "middle"), ("truncation_direction", 1)])
def test_embedding_truncation_fields_take_teis_values_only(app, field, value):
    """TEI's truncate is a JSON boolean (or null), truncation_direction Right / Left: a loose value is
    400 naming the field, not read as true."""
    status, answer = call(app, "/v1/embeddings", json.dumps({"model": "m", "input": "x", field: value}).encode())
    assert status == 400 and error_of(answer)["param"] == field, answer
    for fields in ({"truncate": None, "truncation_direction": None}, {"truncate": True, "truncation_direction": "Left"}):
        assert call(app, "/v1/embeddings", json.dumps({"model": "m", "input": "x", **fields}).encode())[0] == 503
