"""`PoolingServicer`: protobuf in -> `PoolingService` call -> protobuf out, nothing more.

Wire formats: ENCODING_FORMAT_FLOAT fills `embeddings`, one [N, D] float32 tensor; ENCODING_FORMAT_BASE64
fills `embeddings_base64`, one base64 string of little-endian float32 bytes per input (the
OpenAI embeddings API's base64 convention).
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from services.common.tensor import to_pb
from services.pooling.service import Embeddings, PoolingService, Ranking, ServiceInfo
from tessera.v1 import pooling_pb2, pooling_pb2_grpc, tensor_pb2


class PoolingServicer(pooling_pb2_grpc.PoolingServicer):
    def __init__(self, service: PoolingService):
        self.service = service

    async def Embed(self, request: pooling_pb2.EmbedRequest, context) -> pooling_pb2.EmbedResponse:
        normalize = request.normalize if request.HasField("normalize") else None
        result = await self.service.embed(list(request.inputs), normalize=normalize, model=request.model)
        return embeddings_to_pb(result, self.service.config.model_name, request.encoding_format)

    async def Rerank(self, request: pooling_pb2.RerankRequest, context) -> pooling_pb2.RerankResponse:
        top_n = request.top_n if request.HasField("top_n") else None
        ranking = await self.service.rerank(request.query, list(request.documents), top_n=top_n,
                                            return_documents=request.return_documents, model=request.model)
        return ranking_to_pb(ranking, self.service.config.model_name)

    async def GetInfo(self, request: pooling_pb2.PoolingInfoRequest, context) -> pooling_pb2.PoolingInfo:
        return info_to_pb(self.service.info())


def embeddings_to_pb(result: Embeddings, model: str, encoding_format: int) -> pooling_pb2.EmbedResponse:
    usage = _usage(result.num_prompt_tokens)
    vectors = result.vectors.to(torch.float32)  # [N, D]
    if encoding_format == pooling_pb2.ENCODING_FORMAT_BASE64:
        rows = vectors.numpy().astype("<f4", copy=False)
        encoded = [base64.b64encode(np.ascontiguousarray(row).tobytes()).decode("ascii") for row in rows]
        return pooling_pb2.EmbedResponse(model=model, embeddings_base64=encoded, usage=usage)
    return pooling_pb2.EmbedResponse(model=model, embeddings=to_pb(vectors), usage=usage)


def ranking_to_pb(ranking: Ranking, model: str) -> pooling_pb2.RerankResponse:
    results = [pooling_pb2.RerankResult(index=r.index, score=r.score, document=r.document or "")
               for r in ranking.results]
    return pooling_pb2.RerankResponse(model=model, method=ranking.method, results=results,
                                      usage=_usage(ranking.num_prompt_tokens))


def info_to_pb(info: ServiceInfo) -> pooling_pb2.PoolingInfo:
    return pooling_pb2.PoolingInfo(
        model=info.model, pooling_mode=info.pooling_mode, normalize=info.normalize, dimension=info.dimension,
        max_input_length=info.max_input_length, max_batch_size=info.max_batch_size,
        rerank_method=info.rerank_method)


def _usage(num_prompt_tokens: int) -> tensor_pb2.Usage:
    return tensor_pb2.Usage(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens)
