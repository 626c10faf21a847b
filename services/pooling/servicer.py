"""`PoolingServicer`: protobuf in -> `PoolingEngine` call -> protobuf out, nothing more."""

from __future__ import annotations

from services.common.limits import check_rerank, check_tokenize
from services.common.streams import RequestPump
from services.pooling.convert import (
    check_tokenize_fields,
    embed_query_from_pb,
    embeddings_to_pb,
    info_to_pb,
    ranking_to_pb,
    tokenization_to_pb,
    truncation_direction,
)
from services.pooling.engine import PoolingEngine
from tessera.v1 import pooling_pb2, pooling_pb2_grpc


class PoolingServicer(pooling_pb2_grpc.PoolingServicer):
    def __init__(self, engine: PoolingEngine):
        self.engine = engine
        self.limits = engine.config.limits

    async def Embed(self, request: pooling_pb2.EmbedRequest, context) -> pooling_pb2.EmbedResponse:
        result = await self.engine.embed_query(embed_query_from_pb(request, self.limits))
        return embeddings_to_pb(result, request.encoding_format)

    async def EmbedStream(self, request_iterator, context):
        formats: list[int] = []  # encoding format per request, in order
        pump = RequestPump(request_iterator)

        async def queries():
            async for request in pump:
                formats.append(request.encoding_format)
                yield embed_query_from_pb(request, self.limits)

        index = 0
        try:
            async for result in self.engine.embed_stream(queries()):
                yield embeddings_to_pb(result, formats[index])
                index += 1
        except Exception:
            await pump.drain()  # the status after the client's last message (services/common/streams.py)
            raise
        finally:
            pump.cancel()

    async def Rerank(self, request: pooling_pb2.RerankRequest, context) -> pooling_pb2.RerankResponse:
        check_rerank(request, self.limits)
        top_n = request.top_n if request.HasField("top_n") else None
        ranking = await self.engine.rerank(request.query, list(request.documents), top_n=top_n,
                                            return_documents=request.return_documents, model=request.model,
                                            raw_scores=request.raw_scores, method=request.method,
                                            truncate=request.truncate,
                                            truncation_direction=truncation_direction(request))
        return ranking_to_pb(ranking)

    async def Tokenize(self, request: pooling_pb2.TokenizeRequest, context) -> pooling_pb2.TokenizeResponse:
        check_tokenize(request, self.limits)
        check_tokenize_fields(request)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        result = await self.engine.tokenize(list(request.inputs), model=request.model,
                                             add_special_tokens=add_special, prompt_name=request.prompt_name)
        return tokenization_to_pb(result)

    async def GetInfo(self, request: pooling_pb2.PoolingInfoRequest, context) -> pooling_pb2.PoolingInfo:
        return info_to_pb(self.engine.info())
