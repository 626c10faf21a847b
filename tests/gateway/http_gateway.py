"""A gateway core for the HTTP app's tests: it records every request the HTTP door hands it and
answers Generate as the decoder does (token text and bytes, logprobs, the prompt back), so a test
asserts both on what reached the protobuf and on the answer's shape. `Harness` builds the app over
it, on one event loop."""

from __future__ import annotations

import asyncio
import json

from services.gateway.http.app import create_app
from services.gateway.http.backend import Backend
from tessera.v1 import adapters_pb2, decoder_pb2, gateway_pb2, pooling_pb2, tensor_pb2

BASE = "base-model"
ALIASES = ("base-model", "alias-b")
EMBEDDER, EMBEDDER_ALIAS = "embedder", "embedder-alias"
GENERATION_DEFAULTS = {"temperature": 0.7, "top_p": 0.9}

# The prompt every Generate answers with (return_prompt): "The cat" as three tokens.
PROMPT_IDS = [10, 11, 12]
PROMPT_PIECES = [("The", b"The"), (" c", b" c"), ("at", b"at")]
PROMPT_TEXT = "The cat"
# The generated tokens, one message each: " caf", then "é" split over two tokens ("!" after it):
# the decoder's text arrives once the character is whole.
TOKENS = [(20, " caf", b" caf", " caf"), (21, "\ufffd", b"\xc3", ""), (22, "\ufffd!", b"\xa9!", "\u00e9!")]
GENERATED_TEXT = " caf\u00e9!"


def logprob_of(token_id: int) -> float:
    return -0.25 * (token_id % 7 + 1)


def alternatives(k: int) -> list[decoder_pb2.TopLogprob]:
    return [decoder_pb2.TopLogprob(token_id=30 + i, logprob=-0.1 * (i + 1), token=f"alt{i}",
                                   token_bytes=f"alt{i}".encode()) for i in range(k)]


def entry(token_id: int, text: str, data: bytes, k: int, rank: int = 0) -> decoder_pb2.TokenLogprob:
    return decoder_pb2.TokenLogprob(token_id=token_id, logprob=logprob_of(token_id), token=text, token_bytes=data,
                                    top=alternatives(k), rank=rank)


def prompt_rank(token_id: int) -> int:
    """The rank the decoder reports for a prompt token (its place in the whole vocabulary)."""
    return 100 + token_id


def generate(request: decoder_pb2.GenerateRequest) -> list[decoder_pb2.GenerateResponse]:
    """What a decoder answers: per choice min(max_tokens, 3) of TOKENS, one message each."""
    sampling = request.sampling
    count = min(sampling.max_tokens or len(TOKENS), len(TOKENS))
    out = []
    for index in range(max(sampling.n, 1)):
        for i, (token_id, text, data, piece) in enumerate(TOKENS[:count]):
            message = decoder_pb2.GenerateResponse(index=index, token_ids=[token_id], text=piece)
            if sampling.logprobs:
                message.logprobs.append(entry(token_id, text, data, sampling.top_logprobs))
            if i == 0 and request.return_prompt:
                message.prompt_token_ids.extend(PROMPT_IDS)
                message.prompt_text = PROMPT_TEXT
            if i == 0 and sampling.HasField("prompt_logprobs"):
                message.prompt_logprobs.extend(entry(t, text, data, sampling.prompt_logprobs, rank=prompt_rank(t))
                                               for t, (text, data) in zip(PROMPT_IDS[1:], PROMPT_PIECES[1:]))
            if i == count - 1:
                message.finish_reason = "length" if count == sampling.max_tokens else "stop"
                message.usage.CopyFrom(tensor_pb2.Usage(prompt_tokens=len(PROMPT_IDS), completion_tokens=count,
                                                        total_tokens=len(PROMPT_IDS) + count))
            out.append(message)
    return out


class FakeGateway:
    """Records each request (`received`, by RPC name) and answers as a cluster serving BASE (with
    ALIASES) and EMBEDDER (with EMBEDDER_ALIAS)."""

    def __init__(self) -> None:
        self.received: dict[str, list] = {}
        self.refusal: Exception | None = None  # set: every call that records its request raises it

    def _record(self, name: str, request) -> None:
        self.received.setdefault(name, []).append(request)
        if self.refusal is not None:
            raise self.refusal

    def last(self, name: str):
        return self.received[name][-1]

    async def info(self, call):
        decoder = decoder_pb2.DecoderInfo(model=BASE, served_model_names=list(ALIASES), max_model_len=2048,
                                          generation_config="auto", generation_defaults=GENERATION_DEFAULTS)
        embedder = pooling_pb2.PoolingModelInfo(model=EMBEDDER, kind="embedding", aliases=[EMBEDDER_ALIAS],
                                                max_input_length=512)
        return gateway_pb2.ClusterInfo(decoder=decoder, pooling=pooling_pb2.PoolingInfo(
            model=EMBEDDER, models=[embedder], max_batch_size=32))

    async def list_adapters(self, request, call):
        return adapters_pb2.ListAdaptersResponse(adapters=[adapters_pb2.AdapterInfo(name="qv", path="qv-dir",
                                                                                    state="ready")])

    async def generate(self, request, call):
        self._record("Generate", request)
        for message in generate(request):
            yield message

    async def embed(self, request, call):
        self._record("Embed", request)
        return pooling_pb2.EmbedResponse(model=request.model or EMBEDDER, embeddings=tensor_pb2.Tensor(
            shape=[1, 1], data=b"\x00\x00\x80?"), usage=tensor_pb2.Usage(prompt_tokens=1, total_tokens=1))

    async def rerank(self, request, call):
        self._record("Rerank", request)
        return pooling_pb2.RerankResponse(model=request.model or EMBEDDER, results=[
            pooling_pb2.RerankResult(index=i, score=0.5) for i in range(len(request.documents))])

    async def tokenize(self, request, call):
        self._record("Tokenize", request)
        return pooling_pb2.TokenizeResponse(model=request.model, results=[pooling_pb2.TokenizedInput(
            tokens=[pooling_pb2.Token(id=1, text="a")])])

    async def detokenize(self, request, call):
        self._record("Detokenize", request)
        return decoder_pb2.DetokenizeResponse(model=request.model, text="a")


class Harness:
    """The HTTP app over a FakeGateway core, on one event loop."""

    def __init__(self, **app_options) -> None:
        self.gateway = FakeGateway()
        self.loop = asyncio.new_event_loop()
        self.app = create_app(Backend(self.gateway, {}), max_body_bytes=1 << 20, **app_options)

    def close(self) -> None:
        self.loop.close()

    def raw(self, path: str, body: dict | bytes | None) -> tuple[int, bytes]:
        """POST `body` as JSON (bytes: as they are; GET when None); (status, the answer's bytes)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
        sent, unread, done = [], [data], asyncio.Event()

        async def receive():  # the body, then a disconnect once the answer is complete
            if unread:
                return {"type": "http.request", "body": unread.pop(), "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                done.set()

        scope = {"type": "http", "method": "GET" if body is None else "POST", "path": path,
                 "headers": [(b"content-type", b"application/json")], "query_string": b"",
                 "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "server": ("test", 80),
                 "client": ("test", 1), "root_path": ""}
        self.loop.run_until_complete(self.app(scope, receive, send))
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    def post(self, path: str, body: dict | bytes | None) -> tuple[int, dict]:
        status, data = self.raw(path, body)
        return status, json.loads(data)

    def stream(self, path: str, body: dict) -> list[dict]:
        """The server-sent events' payloads of a streamed answer, through the final [DONE]."""
        status, data = self.raw(path, {**body, "stream": True})
        assert status == 200, data
        events = [line.removeprefix("data: ") for line in data.decode().split("\n\n") if line]
        assert events[-1] == "[DONE]", events[-3:]
        return [json.loads(e) for e in events[:-1]]
