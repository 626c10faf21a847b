"""The gateway's public gRPC API: a thin adapter over the in-process core (services/gateway/core.py).

Each RPC hands its request and a `Call` (the client's deadline and its `authorization` metadata,
which admin calls relay to the adapter registry) to the core; domain errors become statuses in
the server's ErrorInterceptor. Each Generate's initial metadata names its replica
(`tessera-replica: host:port`). API keys are checked before the servicer (api_keys.py).
"""

from __future__ import annotations

from contextlib import aclosing

from services.gateway.core import INFO_TIMEOUT_S, Call, GatewayCore
from tessera.protocol import REPLICA_METADATA
from tessera.v1 import gateway_pb2_grpc

__all__ = ["INFO_TIMEOUT_S", "REPLICA_METADATA", "GatewayServicer"]



def _call(context) -> Call:
    """The core's view of a gRPC call: its remaining time and its admin credentials."""
    authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
    return Call.within(context.time_remaining(), authorization)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore):
        self.core = core

    async def Generate(self, request, context):
        call = _call(context)
        streamed = False
        async with aclosing(self.core.generate(request, call)) as responses:  # a client gone cancels the decoder's call
            async for response in responses:
                if not streamed:
                    await context.send_initial_metadata(((REPLICA_METADATA, call.replica),))
                    streamed = True
                yield response

    async def Embed(self, request, context):
        return await self.core.embed(request, _call(context))

    async def Rerank(self, request, context):
        return await self.core.rerank(request, _call(context))

    async def EmbedStream(self, request_iterator, context):
        async with aclosing(self.core.embed_stream(request_iterator, _call(context))) as responses:
            async for response in responses:
                yield response

    async def Tokenize(self, request, context):
        return await self.core.tokenize(request, _call(context))

    async def Detokenize(self, request, context):
        return await self.core.detokenize(request, _call(context))

    async def LoadAdapter(self, request, context):
        return await self.core.load_adapter(request, _call(context))

    async def UnloadAdapter(self, request, context):
        return await self.core.unload_adapter(request, _call(context))

    async def ListAdapters(self, request, context):
        return await self.core.list_adapters(request, _call(context))

    async def GetInfo(self, request, context):
        return await self.core.info(_call(context))
