"""The Python client for a tessera cluster: `Client` (blocking) and `AsyncClient` (asyncio) over
the gateway's gRPC API, returning typed results and raising `TesseraError` subclasses.

    from tessera.client import Client

    with Client("localhost:50051") as client:
        for delta in (stream := client.chat_stream([{"role": "user", "content": "Hi!"}], max_tokens=32)):
            print(delta.text, end="", flush=True)
        print(stream.result.usage)

It needs grpcio (and grpcio-status), protobuf and numpy, never torch or transformers.
"""

from tessera.client.aio import AsyncClient, AsyncGenerateStream
from tessera.client.channel import DEFAULT_ADDRESS, NO_RETRY, RetryPolicy
from tessera.client.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TesseraError,
    Unauthenticated,
    Unavailable,
)
from tessera.client.sync import Client, GenerateStream
from tessera.client.types import (
    AdapterInfo,
    Choice,
    ClusterInfo,
    EmbedResult,
    GenerateDelta,
    GenerateResult,
    Message,
    RerankItem,
    RerankResult,
    SamplingParams,
    Token,
    TokenizeResult,
    Usage,
)

__all__ = [
    "AdapterInfo", "AlreadyExists", "AsyncClient", "AsyncGenerateStream", "Cancelled", "Choice", "Client",
    "ClusterInfo", "DEFAULT_ADDRESS", "DeadlineExceeded", "EmbedResult", "FailedPrecondition", "GenerateDelta",
    "GenerateResult", "GenerateStream", "Internal", "InvalidArgument", "Message", "NO_RETRY", "NotFound",
    "PermissionDenied", "RerankItem", "RerankResult", "ResourceExhausted", "RetryPolicy", "SamplingParams",
    "TesseraError", "Token", "TokenizeResult", "Unauthenticated", "Unavailable", "Usage",
]
