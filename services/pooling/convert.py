"""Pooling domain types <-> tessera.v1 protobuf messages (the only place that knows both).

Wire formats: ENCODING_FORMAT_FLOAT fills `embeddings`, one [N, D] float32 tensor; ENCODING_FORMAT_BASE64
fills `embeddings_base64`, one base64 string of little-endian float32 bytes per input (the
OpenAI embeddings API's base64 convention).
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from services.common.errors import InvalidArgument
from services.common.limits import PoolingLimits, check_embed
from services.common.tensor import to_pb
from services.pooling.types import Embeddings, EmbedQuery, PoolingInfo, Ranking, Tokenization
from tessera.v1 import pooling_pb2, tensor_pb2

_DIRECTIONS = {pooling_pb2.TRUNCATION_DIRECTION_RIGHT: "right", pooling_pb2.TRUNCATION_DIRECTION_LEFT: "left"}


def embed_query_from_pb(request: pooling_pb2.EmbedRequest, limits: PoolingLimits | None = None) -> EmbedQuery:
    """Raises InvalidArgument: a cap of `limits` passed (checked first), or an unknown enum value."""
    if limits is not None:
        check_embed(request, limits)
    if request.encoding_format not in pooling_pb2.EncodingFormat.values():
        raise InvalidArgument(f"encoding_format {request.encoding_format} is not one of "
                              f"{dict(pooling_pb2.EncodingFormat.items())}")
    return EmbedQuery(
        texts=tuple(request.inputs), token_ids=tuple(tuple(t.ids) for t in request.input_ids),
        normalize=request.normalize if request.HasField("normalize") else None, model=request.model,
        truncate=request.truncate, truncation_direction=truncation_direction(request),
        dimensions=request.dimensions if request.HasField("dimensions") else None, prompt_name=request.prompt_name)


def truncation_direction(request: pooling_pb2.EmbedRequest | pooling_pb2.RerankRequest) -> str:
    """The request's direction as the tokenizer names it ("right" or "left").

    Raises:
        InvalidArgument: a value outside the enum (protobuf keeps unknown enum numbers as they came).
    """
    value = request.truncation_direction
    if value not in _DIRECTIONS:
        raise InvalidArgument(f"truncation_direction {value} is not one of {dict(pooling_pb2.TruncationDirection.items())}")
    return _DIRECTIONS[value]


_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")


def check_tokenize_fields(request: pooling_pb2.TokenizeRequest) -> None:
    """A pooling model tokenizes texts: the chat-template fields (decoder models') are refused, not dropped.

    Raises:
        InvalidArgument: naming the first chat field set.
    """
    for name in _CHAT_FIELDS:
        value = getattr(request, name)
        if (request.HasField(name) if name == "add_generation_prompt" else bool(value)):
            raise InvalidArgument(f"{name} is for decoder models (their chat template); pooling models tokenize "
                                  "`inputs`")


def embeddings_to_pb(result: Embeddings, encoding_format: int) -> pooling_pb2.EmbedResponse:
    usage = _usage(result.num_prompt_tokens)
    vectors = result.vectors.to(torch.float32).contiguous()  # [N, D]
    if encoding_format == pooling_pb2.ENCODING_FORMAT_BASE64:
        rows = vectors.numpy().astype("<f4", copy=False)
        encoded = [base64.b64encode(np.ascontiguousarray(row).tobytes()).decode("ascii") for row in rows]
        return pooling_pb2.EmbedResponse(model=result.model, embeddings_base64=encoded, usage=usage)
    return pooling_pb2.EmbedResponse(model=result.model, embeddings=to_pb(vectors), usage=usage)


def ranking_to_pb(ranking: Ranking) -> pooling_pb2.RerankResponse:
    results = [pooling_pb2.RerankResult(index=r.index, score=r.score, document=r.document or "")
               for r in ranking.results]
    return pooling_pb2.RerankResponse(model=ranking.model, method=ranking.method, results=results,
                                      usage=_usage(ranking.num_prompt_tokens))


def tokenization_to_pb(result: Tokenization) -> pooling_pb2.TokenizeResponse:
    return pooling_pb2.TokenizeResponse(model=result.model, results=[
        pooling_pb2.TokenizedInput(tokens=[pooling_pb2.Token(id=t.id, text=t.text, special=t.special, start=t.start,
                                                             stop=t.stop) for t in tokens])
        for tokens in result.results])


def info_to_pb(info: PoolingInfo) -> pooling_pb2.PoolingInfo:
    models = [pooling_pb2.PoolingModelInfo(
        model=m.model, kind=m.kind, pooling_mode=m.pooling_mode, normalize=m.normalize, dimension=m.dimension,
        max_input_length=m.max_input_length, rerank_method=m.rerank_method, matryoshka=m.matryoshka,
        matryoshka_dimensions=list(m.matryoshka_dimensions), prompts=m.prompts, aliases=list(m.aliases))
        for m in info.models]
    return pooling_pb2.PoolingInfo(
        model=info.model, pooling_mode=info.pooling_mode, normalize=info.normalize, dimension=info.dimension,
        max_input_length=info.max_input_length, max_batch_size=info.max_batch_size,
        rerank_method=info.rerank_method, models=models, max_batch_tokens=info.max_batch_tokens,
        max_queue_size=info.max_queue_size, max_wait_ms=info.max_wait_ms, dynamic_batching=info.dynamic_batching)


def _usage(num_prompt_tokens: int) -> tensor_pb2.Usage:
    return tensor_pb2.Usage(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens)

