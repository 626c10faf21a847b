"""`AsyncClient`: the asyncio tessera client; the same methods as `Client`, awaited."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterable, Sequence

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


class AsyncGenerateStream:
    """`async for` it for `GenerateDelta`s; `result` holds the whole answer once it has ended.
    Retries happen only before the first message; leaving the loop early cancels the request."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub, request, metadata, deadline: Deadline,
                 retry: RetryPolicy):
        self._stub, self._request, self._metadata = stub, request, metadata
        self._deadline, self._retry = deadline, retry
        self._builder = convert.ResultBuilder(request.request_id)
        self._result: GenerateResult | None = None
        self._started = False

    async def __aiter__(self) -> AsyncIterator[GenerateDelta]:
        if self._started:
            raise RuntimeError("a stream is read once; start another call for another answer")
        self._started = True
        for attempt in range(1, self._retry.max_attempts + 1):
            call = self._stub.Generate(self._request, timeout=self._deadline.remaining(), metadata=self._metadata)
            received = False
            try:
                async for response in call:
                    if not received:
                        received = True
                        self._builder.replica = dict(await call.initial_metadata() or ()).get(REPLICA_METADATA, "")
                    yield self._builder.add(response)
                break
            except grpc.RpcError as error:
                wait = self._retry.backoff_s(attempt)
                if (received or not retryable(error) or attempt == self._retry.max_attempts
                        or not self._deadline.allows(wait)):
                    raise from_rpc_error(error) from None
                await asyncio.sleep(wait)
            finally:
                call.cancel()
        self._result = self._builder.result()

    @property
    def result(self) -> GenerateResult:
        """The finished answer; RuntimeError until the stream has been read to its end."""
        if self._result is None:
            raise RuntimeError("the stream has not ended: iterate it first")
        return self._result


class AsyncClient:
    """A connection to a tessera gateway for asyncio code: arguments, methods and errors as
    `tessera.client.Client`, every call awaited (streams with `async for`). Create it inside the
    event loop that uses it; close it with `await client.close()` or `async with`."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, api_token: str | None = None,
                 admin_token: str | None = None, tls: bool | None = None,
                 root_cert: str | os.PathLike | bytes | None = None, timeout: float | None = None,
                 retry: RetryPolicy | None = None):
        self.settings = Settings.resolve(address, api_token=api_token, admin_token=admin_token, tls=tls,
                                         root_cert=root_cert, timeout=timeout, retry=retry)
        credentials = self.settings.credentials()
        self._channel = (grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS) if credentials
                         else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(timeout if timeout is not None else self.settings.timeout)

    async def _unary(self, method: str, request, timeout: float | None, admin: bool = False):
        deadline, retry = self._deadline(timeout), NO_RETRY if admin else self.settings.retry
        for attempt in range(1, retry.max_attempts + 1):
            try:
                return await getattr(self._stub, method)(request, timeout=deadline.remaining(),
                                                         metadata=self.settings.metadata(admin))
            except grpc.RpcError as error:
                wait = retry.backoff_s(attempt)
                if not retryable(error) or attempt == retry.max_attempts or not deadline.allows(wait):
                    raise from_rpc_error(error) from None
                await asyncio.sleep(wait)

    def generate_stream(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None, *,
                        images: Sequence[ImageLike] = (), lora: str = "", request_id: str | None = None,
                        timeout: float | None = None, **sampling_fields) -> AsyncGenerateStream:
        """As Client.generate_stream; iterate with `async for`."""
        request = convert.generate_request(prompt=prompt, images=images, lora=lora, request_id=request_id,
                                           sampling=merge_sampling(sampling, sampling_fields))
        return AsyncGenerateStream(self._stub, request, self.settings.metadata(), self._deadline(timeout),
                                   self.settings.retry)

    async def generate(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                       **kwargs) -> GenerateResult:
        return await _drain(self.generate_stream(prompt, sampling, **kwargs))

    def chat_stream(self, messages: Iterable[Message | dict], sampling: SamplingParams | None = None, *,
                    lora: str = "", request_id: str | None = None, timeout: float | None = None,
                    tools: Sequence[dict] = (), **sampling_fields) -> AsyncGenerateStream:
        """As Client.chat_stream; iterate with `async for`."""
        request = convert.generate_request(messages=messages, lora=lora, request_id=request_id,
                                           sampling=merge_sampling(sampling, sampling_fields), tools=tools)
        return AsyncGenerateStream(self._stub, request, self.settings.metadata(), self._deadline(timeout),
                                   self.settings.retry)

    async def chat(self, messages: Iterable[Message | dict], sampling: SamplingParams | None = None,
                   **kwargs) -> GenerateResult:
        return await _drain(self.chat_stream(messages, sampling, **kwargs))

    async def embed(self, inputs: str | Sequence[str] | None = None, *,
                    input_ids: Sequence[Sequence[int]] | None = None, model: str = "", normalize: bool | None = None,
                    dimensions: int | None = None, truncate: bool = False, truncation_direction: str = "right",
                    prompt_name: str = "", encoding_format: str = "float",
                    timeout: float | None = None) -> EmbedResult:
        request = convert.embed_request(inputs, input_ids=input_ids, model=model, normalize=normalize,
                                        dimensions=dimensions, truncate=truncate, prompt_name=prompt_name,
                                        encoding_format=encoding_format, direction=truncation_direction)
        return convert.embed_result(await self._unary("Embed", request, timeout))

    async def rerank(self, query: str, documents: Sequence[str], *, top_n: int | None = None,
                     return_documents: bool = False, model: str = "", raw_scores: bool = False,
                     truncate: bool = False, truncation_direction: str = "right",
                     timeout: float | None = None) -> RerankResult:
        request = convert.rerank_request(query, documents, top_n=top_n, return_documents=return_documents,
                                         model=model, raw_scores=raw_scores, truncate=truncate,
                                         direction=truncation_direction)
        return convert.rerank_result(await self._unary("Rerank", request, timeout))

    async def tokenize(self, inputs: str | Sequence[str] | None = None, *, messages: Iterable[Message | dict] | None = None,
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
        return convert.tokenize_result(await self._unary("Tokenize", request, timeout))

    async def detokenize(self, token_ids: Sequence[int], *, model: str, skip_special_tokens: bool = False,
                         timeout: float | None = None) -> str:
        """The text of `token_ids` by the decoder's tokenizer; `model`: its name or a loaded adapter's.
        InvalidArgument for a pooling model, an id out of vocabulary or more ids than the context."""
        request = decoder_pb2.DetokenizeRequest(model=model, token_ids=list(token_ids),
                                                skip_special_tokens=skip_special_tokens)
        return (await self._unary("Detokenize", request, timeout)).text

    async def load_adapter(self, name: str, path: str, *, replace: bool = False, drain: bool = False,
                           timeout: float | None = None) -> AdapterInfo:
        request = adapters_pb2.LoadAdapterRequest(name=name, path=path, replace=replace, drain=drain)
        return convert.from_pb(AdapterInfo, await self._unary("LoadAdapter", request, timeout, admin=True))

    async def unload_adapter(self, name: str, *, drain: bool = False, timeout: float | None = None) -> None:
        await self._unary("UnloadAdapter", adapters_pb2.UnloadAdapterRequest(name=name, drain=drain), timeout,
                          admin=True)

    async def list_adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        listing = await self._unary("ListAdapters", adapters_pb2.ListAdaptersRequest(), timeout)
        return [convert.from_pb(AdapterInfo, a) for a in listing.adapters]

    async def info(self, *, timeout: float | None = None) -> ClusterInfo:
        return convert.cluster_info(await self._unary("GetInfo", gateway_pb2.ClusterInfoRequest(), timeout))


async def _drain(stream: AsyncGenerateStream) -> GenerateResult:
    async for _ in stream:
        pass
    return stream.result
