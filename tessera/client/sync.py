"""`Client`: the synchronous tessera client over the gateway's gRPC API."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence

import grpc

from tessera.client import convert
from tessera.client.channel import (
    DEFAULT_ADDRESS,
    NO_RETRY,
    Deadline,
    RetryPolicy,
    Settings,
    merge_sampling,
    retryable,
)
from tessera.client.errors import from_rpc_error
from tessera.client.types import (
    AdapterInfo,
    ClusterInfo,
    EmbedResult,
    GenerateDelta,
    GenerateResult,
    ImageLike,
    Message,
    RerankResult,
    SamplingParams,
    TokenizeResult,
)
from tessera.protocol import CHANNEL_OPTIONS, REPLICA_METADATA
from tessera.v1 import adapters_pb2, decoder_pb2, gateway_pb2, gateway_pb2_grpc


class GenerateStream:
    """Iterate it for `GenerateDelta`s as the decoder produces them; `result` holds the whole
    answer once the stream has ended. Retries (see RetryPolicy) happen only before the first
    message, so no delta is ever repeated. Leaving the loop early cancels the request."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub, request, metadata, deadline: Deadline,
                 retry: RetryPolicy):
        self._stub, self._request, self._metadata = stub, request, metadata
        self._deadline, self._retry = deadline, retry
        self._builder = convert.ResultBuilder(request.request_id)
        self._result: GenerateResult | None = None
        self._started = False

    def __iter__(self) -> Iterator[GenerateDelta]:
        if self._started:
            raise RuntimeError("a stream is read once; start another call for another answer")
        self._started = True
        for attempt in range(1, self._retry.max_attempts + 1):
            call = self._stub.Generate(self._request, timeout=self._deadline.remaining(), metadata=self._metadata)
            received = False
            try:
                for response in call:
                    if not received:
                        received = True
                        self._builder.replica = dict(call.initial_metadata() or ()).get(REPLICA_METADATA, "")
                    yield self._builder.add(response)
                break
            except grpc.RpcError as error:
                wait = self._retry.backoff_s(attempt)
                if (received or not retryable(error) or attempt == self._retry.max_attempts
                        or not self._deadline.allows(wait)):
                    raise from_rpc_error(error) from None
                time.sleep(wait)
            finally:
                call.cancel()  # no-op once the call has ended; frees the request when the caller stops early
        self._result = self._builder.result()

    @property
    def result(self) -> GenerateResult:
        """The finished answer; RuntimeError until the stream has been read to its end."""
        if self._result is None:
            raise RuntimeError("the stream has not ended: iterate it first")
        return self._result


class Client:
    """A connection to a tessera gateway.

    `address` is a gRPC target ("host:port", "dns:///name:port", ...). `api_token` is sent as a
    bearer token on every call, `admin_token` on adapter load/unload (defaults: $TESSERA_API_TOKEN,
    $TESSERA_ADMIN_TOKEN). `root_cert` (PEM bytes or a file path; default $TESSERA_TLS_ROOT_CERT)
    or `tls=True` (the system's roots) make the connection TLS. `timeout` is every call's default
    deadline in seconds (None: no deadline), overridden per call. `retry` says how calls that end
    UNAVAILABLE before returning anything are retried (RetryPolicy; NO_RETRY to turn it off).
    Errors are raised as tessera.client.errors.TesseraError subclasses.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, *, api_token: str | None = None,
                 admin_token: str | None = None, tls: bool | None = None,
                 root_cert: str | os.PathLike | bytes | None = None, timeout: float | None = None,
                 retry: RetryPolicy | None = None):
        self.settings = Settings.resolve(address, api_token=api_token, admin_token=admin_token, tls=tls,
                                         root_cert=root_cert, timeout=timeout, retry=retry)
        credentials = self.settings.credentials()
        self._channel = (grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS) if credentials
                         else grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(timeout if timeout is not None else self.settings.timeout)

    def _unary(self, method: str, request, timeout: float | None, admin: bool = False):
        """One unary call; reads (not admin calls, which change state) retry on UNAVAILABLE."""
        deadline, retry = self._deadline(timeout), NO_RETRY if admin else self.settings.retry
        for attempt in range(1, retry.max_attempts + 1):
            try:
                return getattr(self._stub, method)(request, timeout=deadline.remaining(),
                                                   metadata=self.settings.metadata(admin))
            except grpc.RpcError as error:
                wait = retry.backoff_s(attempt)
                if not retryable(error) or attempt == retry.max_attempts or not deadline.allows(wait):
                    raise from_rpc_error(error) from None
                time.sleep(wait)

    # --- generation -----------------------------------------------------------------------------

    def generate_stream(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None, *,
                        images: Sequence[ImageLike] = (), lora: str = "", request_id: str | None = None,
                        timeout: float | None = None, **sampling_fields) -> GenerateStream:
        """Stream a completion of a raw prompt (text, no chat template; or token ids).

        `images` (bytes, paths, PIL images) go before the text. `lora` names a registry adapter
        ("" = the base model). Sampling comes from `sampling` with `sampling_fields` (the names of
        SamplingParams: max_tokens, temperature, ...) replaced. Raises TesseraError subclasses
        while iterating (InvalidArgument for bad input, NotFound for an unknown adapter, ...).
        """
        request = convert.generate_request(prompt=prompt, images=images, lora=lora, request_id=request_id,
                                           sampling=merge_sampling(sampling, sampling_fields))
        return GenerateStream(self._stub, request, self.settings.metadata(), self._deadline(timeout),
                              self.settings.retry)

    def generate(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                 **kwargs) -> GenerateResult:
        """`generate_stream(...)` read to its end: the whole answer."""
        return _drain(self.generate_stream(prompt, sampling, **kwargs))

    def chat_stream(self, messages: Iterable[Message | dict], sampling: SamplingParams | None = None, *,
                    lora: str = "", request_id: str | None = None, timeout: float | None = None,
                    tools: Sequence[dict] = (), **sampling_fields) -> GenerateStream:
        """Stream an answer to chat `messages`, rendered with the model's chat template.

        Each message is a Message or a dict with "role" and "content"; content is a str or a list
        of parts: str = text; bytes, a pathlib.Path or a PIL image = an image; or OpenAI's content
        parts, {"type": "text", "text": ...} and {"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}}. A dict may carry OpenAI's "tool_calls" (an assistant's) and
        "tool_call_id" (a "tool" message's); `tools` (OpenAI's tool objects) go to the chat
        template, and the answer is the model's text (the HTTP API parses tool calls out of it).
        ValueError (before any call) for another part type, naming it, or an image URL that is not
        a base64 data URI. Otherwise as generate_stream.
        """
        request = convert.generate_request(messages=messages, lora=lora, request_id=request_id,
                                           sampling=merge_sampling(sampling, sampling_fields), tools=tools)
        return GenerateStream(self._stub, request, self.settings.metadata(), self._deadline(timeout),
                              self.settings.retry)

    def chat(self, messages: Iterable[Message | dict], sampling: SamplingParams | None = None,
             **kwargs) -> GenerateResult:
        """`chat_stream(...)` read to its end: the whole answer."""
        return _drain(self.chat_stream(messages, sampling, **kwargs))

    # --- pooling --------------------------------------------------------------------------------

    def embed(self, inputs: str | Sequence[str] | None = None, *, input_ids: Sequence[Sequence[int]] | None = None,
              model: str = "", normalize: bool | None = None, dimensions: int | None = None,
              truncate: bool = False, truncation_direction: str = "right", prompt_name: str = "",
              encoding_format: str = "float", timeout: float | None = None) -> EmbedResult:
        """Embeddings [N, D] float32 of texts (or pre-tokenized `input_ids`), in input order.

        `normalize` None follows the model's config; `dimensions` only for Matryoshka models;
        `truncate` False refuses an input past the model's max length, True cuts it at the
        `truncation_direction` end ("right": keeps the first tokens, "left": the last); `encoding_format` "base64"
        changes only the wire format (same vectors).
        """
        request = convert.embed_request(inputs, input_ids=input_ids, model=model, normalize=normalize,
                                        dimensions=dimensions, truncate=truncate, prompt_name=prompt_name,
                                        encoding_format=encoding_format, direction=truncation_direction)
        return convert.embed_result(self._unary("Embed", request, timeout))

    def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None,
               return_documents: bool = False, model: str = "", raw_scores: bool = False,
               truncate: bool = False, truncation_direction: str = "right",
               timeout: float | None = None) -> RerankResult:
        """Documents scored for `query`, highest first (the top `top_n`, default all); `truncate`
        False refuses a pair (or text) past the model's max length, True cuts it (a cross-encoder's
        pair from the longer side first, as sentence-transformers' CrossEncoder; `truncation_direction`
        "right" keeps the first tokens, "left" the last)."""
        request = convert.rerank_request(query, documents, top_n=top_n, return_documents=return_documents,
                                         model=model, raw_scores=raw_scores, truncate=truncate,
                                         direction=truncation_direction)
        return convert.rerank_result(self._unary("Rerank", request, timeout))

    def tokenize(self, inputs: str | Sequence[str] | None = None, *, messages: Iterable[Message | dict] | None = None,
                 model: str = "", add_special_tokens: bool | None = None, prompt_name: str = "",
                 timeout: float | None = None) -> TokenizeResult:
        """Tokens of each input by `model`'s tokenizer. "" (the served model, as vLLM's /tokenize),
        one of the decoder's served names or a loaded adapter's name: the decoder's, for one input
        or chat `messages` rendered with its chat template; "" is the default embedding model's when
        the cluster has no decoder. A pooling model's name or alias: that model's, with character
        offsets. `result.model` names the model that tokenized (its first served name).
        NotFound for an unknown model; InvalidArgument for several inputs to the decoder."""
        request = convert.tokenize_request(inputs, messages=messages, model=model,
                                           add_special_tokens=add_special_tokens, prompt_name=prompt_name)
        return convert.tokenize_result(self._unary("Tokenize", request, timeout))

    def detokenize(self, token_ids: Sequence[int], *, model: str, skip_special_tokens: bool = False,
                   timeout: float | None = None) -> str:
        """The text of `token_ids` by the decoder's tokenizer; `model`: its name or a loaded adapter's.
        InvalidArgument for a pooling model, an id out of vocabulary or more ids than the context."""
        request = decoder_pb2.DetokenizeRequest(model=model, token_ids=list(token_ids),
                                                skip_special_tokens=skip_special_tokens)
        return (self._unary("Detokenize", request, timeout)).text

    # --- adapters and cluster -------------------------------------------------------------------

    def load_adapter(self, name: str, path: str, *, replace: bool = False, drain: bool = False,
                     timeout: float | None = None) -> AdapterInfo:
        """Register the PEFT LoRA directory `path` (inside the registry's adapter root) as `name`.
        An admin call (admin token); never retried. AlreadyExists unless `replace`."""
        request = adapters_pb2.LoadAdapterRequest(name=name, path=path, replace=replace, drain=drain)
        return convert.from_pb(AdapterInfo, self._unary("LoadAdapter", request, timeout, admin=True))

    def unload_adapter(self, name: str, *, drain: bool = False, timeout: float | None = None) -> None:
        """Remove `name` from the registry (admin). FailedPrecondition while leased, unless `drain`."""
        self._unary("UnloadAdapter", adapters_pb2.UnloadAdapterRequest(name=name, drain=drain), timeout, admin=True)

    def list_adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        listing = self._unary("ListAdapters", adapters_pb2.ListAdaptersRequest(), timeout)
        return [convert.from_pb(AdapterInfo, a) for a in listing.adapters]

    def info(self, *, timeout: float | None = None) -> ClusterInfo:
        """The cluster's models, limits and replicas (health, queue, KV usage, resident adapters)."""
        return convert.cluster_info(self._unary("GetInfo", gateway_pb2.ClusterInfoRequest(), timeout))


def _drain(stream: GenerateStream) -> GenerateResult:
    for _ in stream:
        pass
    return stream.result
