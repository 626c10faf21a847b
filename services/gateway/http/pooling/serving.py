"""Embeddings, rerank and score: HTTP bodies (protocol.py, and TEI's embed body) <-> the pooling
service's messages, through the gateway's core.
"""

from __future__ import annotations

import struct
import uuid

from services.gateway.core import Call
from services.gateway.http.backend import Backend
from services.gateway.http.errors import ApiError
from services.gateway.http.pooling.protocol import (
    EmbeddingRequest,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from services.gateway.http.protocol import Usage
from services.gateway.http.tei.protocol import TeiEmbedRequest
from tessera.v1 import pooling_pb2


def embed_fields(body: EmbeddingRequest | TeiEmbedRequest) -> dict[str, str]:
    """The embeddings body's names for Embed's fields (`input`, TEI's `inputs`; a lone text or id
    list is the field itself)."""
    name = "inputs" if isinstance(body, TeiEmbedRequest) else "input"
    data = body.inputs if isinstance(body, TeiEmbedRequest) else body.input
    fields = {"inputs": name, "input_ids": name}
    if isinstance(data, str) or (data and isinstance(data[0], int)):
        fields |= {"inputs.0": name, "input_ids.0": name}
    return fields


RERANK_FIELDS = {"documents": "documents"}
TEI_RERANK_FIELDS = {"documents": "texts"}
SCORE_FIELDS = {"query": "text_1", "documents": "text_2"}


def _direction(name: str | None) -> int:
    """TEI's truncation_direction (either spelling; None: right) as the protobuf enum."""
    return (pooling_pb2.TRUNCATION_DIRECTION_LEFT if (name or "").lower() == "left"
            else pooling_pb2.TRUNCATION_DIRECTION_RIGHT)


def _truncation(body) -> dict:
    """The pooling request's truncate and truncation_direction, from TEI's fields or vLLM's
    `truncate_prompt_tokens` (-1: cut to the model's maximum input length, keeping the last tokens).

    Raises:
        ApiError: 400 for another truncate_prompt_tokens (a cut to k tokens is not supported).
    """
    tokens = getattr(body, "truncate_prompt_tokens", None)
    if tokens is not None:
        if tokens != -1:
            raise ApiError(400, f"truncate_prompt_tokens {tokens} is not supported: -1 (cut an input to the model's "
                                "maximum input length, keeping its last tokens) is, or truncate: true",
                           param="truncate_prompt_tokens")
        return {"truncate": True, "truncation_direction": pooling_pb2.TRUNCATION_DIRECTION_LEFT}
    return {"truncate": bool(body.truncate), "truncation_direction": _direction(getattr(body, "truncation_direction",
                                                                                       None))}


def usage(*replies) -> Usage:
    """The pooling answers' usage, summed (a total_tokens left 0 counts as the prompt's tokens)."""
    return Usage(prompt_tokens=sum(r.usage.prompt_tokens for r in replies),
                        total_tokens=sum(r.usage.total_tokens or r.usage.prompt_tokens for r in replies))


def embed_request(body: EmbeddingRequest | TeiEmbedRequest, model: str) -> pooling_pb2.EmbedRequest:
    """Texts or token ids for `model` (canonical); `dimensions`, the format, normalize and truncation pass
    through (pooling checks them). TEI's body (`inputs`) also sets prompt_name, and normalize by TEI's
    default (true)."""
    tei = isinstance(body, TeiEmbedRequest)
    fmt = (pooling_pb2.ENCODING_FORMAT_BASE64 if not tei and body.encoding_format == "base64"
           else pooling_pb2.ENCODING_FORMAT_FLOAT)
    request = pooling_pb2.EmbedRequest(model=model, encoding_format=fmt, **_truncation(body))
    if body.dimensions is not None:
        request.dimensions = body.dimensions
    if body.normalize is not None:
        request.normalize = body.normalize
    if tei:
        request.prompt_name = body.prompt_name or ""
    data = body.inputs if tei else body.input
    if isinstance(data, str):
        request.inputs.append(data)
    elif data and isinstance(data[0], int):
        request.input_ids.add(ids=data)
    elif data and isinstance(data[0], list):
        for ids in data:
            request.input_ids.add(ids=ids)
    else:
        request.inputs.extend(data)
    return request


def embeddings(reply: pooling_pb2.EmbedResponse) -> list[list[float] | str]:
    """One vector (float list) or base64 string per input, in input order."""
    if reply.embeddings_base64:
        return list(reply.embeddings_base64)
    tensor = reply.embeddings
    if not tensor.shape:
        return []
    rows, dim = tensor.shape
    values = struct.unpack(f"<{rows * dim}f", tensor.data)
    return [list(values[r * dim:(r + 1) * dim]) for r in range(rows)]


def _raw_scores(body: RerankRequest | ScoreRequest) -> bool:
    """TEI's raw_scores, or vLLM's activation / use_activation false.

    Raises:
        ApiError: 400 when they contradict (raw_scores true with an activation true).
    """
    raw = getattr(body, "raw_scores", False)
    for name in ("activation", "use_activation"):
        value = getattr(body, name)
        if value is True and raw:
            raise ApiError(400, f"{name} true and raw_scores true contradict: the activation or the raw logit",
                           param=name)
        raw = raw or value is False
    return raw


def rerank_request(body: RerankRequest, model: str, tei_allowed: bool) -> pooling_pb2.RerankRequest:
    """Jina's / Cohere's body (`documents`) or, where `tei_allowed`, TEI's (`texts`), for `model` (canonical).

    Raises:
        ApiError: 400 unless exactly one of documents and texts is set (texts only where allowed).
    """
    if body.texts is not None and not tei_allowed:
        raise ApiError(400, "texts is TEI's field, taken on POST /rerank; send documents here", param="texts")
    if (body.documents is None) == (body.texts is None):
        raise ApiError(400, "send exactly one of documents (Jina's, Cohere's) or texts (TEI's)",
                       param="documents" if body.documents is None else "texts")
    tei = body.texts is not None
    documents = body.texts if tei else [d if isinstance(d, str) else d.text for d in body.documents]
    request = pooling_pb2.RerankRequest(model=model, query=body.query, documents=documents,
                                        return_documents=body.return_text if tei else body.return_documents,
                                        raw_scores=_raw_scores(body), **_truncation(body))
    if body.top_n is not None:
        request.top_n = body.top_n
    return request


def score_requests(body: ScoreRequest, model: str) -> list[pooling_pb2.RerankRequest]:
    """vLLM's /score pairs as Rerank calls: one text against many is one call, pairwise lists one
    call per pair (each a query with one document). Scores come back in the pairs' order
    (`scores`).

    Raises:
        ApiError: 400 for two lists of different lengths, or an empty one.
    """
    first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts:
            raise ApiError(400, f"{name} is empty; send a text or a list of texts", param=name)
    common = {"model": model, "raw_scores": _raw_scores(body), **_truncation(body)}
    if len(first) == 1:
        return [pooling_pb2.RerankRequest(query=first[0], documents=second, **common)]
    if len(first) != len(second):
        raise ApiError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}; pairwise scoring needs lists "
                            "of equal length (or text_1 a single text)", param="text_2")
    return [pooling_pb2.RerankRequest(query=q, documents=[d], **common) for q, d in zip(first, second, strict=True)]


def scores(replies: list[pooling_pb2.RerankResponse]) -> ScoreResponse:
    """The replies of `score_requests`' calls as vLLM's /score answer, in the pairs' order."""
    by_pair = [r.score for reply in replies for r in sorted(reply.results, key=lambda r: r.index)]
    return ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=replies[0].model,
                                data=[ScoreData(index=i, score=s) for i, s in enumerate(by_pair)],
                                usage=usage(*replies))


def rerank_response(reply: pooling_pb2.RerankResponse) -> RerankResponse:
    results = [RerankResult(index=r.index, relevance_score=r.score,
                                   document=RerankDocument(text=r.document) if r.document else None)
               for r in reply.results]
    return RerankResponse(model=reply.model, results=results, usage=usage(reply))


async def embed(backend: Backend, request):
    backend.check_size(request)
    return await backend.core.embed(request, Call())


async def rerank(backend: Backend, request):
    backend.check_size(request)
    return await backend.core.rerank(request, Call())
