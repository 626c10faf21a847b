"""Request bodies and answers of /v1/embeddings, /v1/rerank (and /rerank: Jina's, Cohere's) and
/v1/score (and /score: vLLM's), in their shapes (the field rule: ../fields.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, Field

from services.gateway.http.fields import Body, Refusal, Strict, accepted
from services.gateway.http.protocol import Count, Direction, Texts, TokenIdLists, TokenIds, Usage

TRUNCATE_PROMPT_TOKENS = Field(default=None, description="vLLM's: -1 cuts an input past the model's maximum "
                                "input length to its last tokens; other values are refused (see truncate)")
ACTIVATION = "vLLM's: false gives the raw logit (TEI's raw_scores)"
POOLING_REFUSED = {
    "priority": Refusal("the pooling service batches requests first come, first served", (0,)),
    "mm_processor_kwargs": Refusal("the pooling models take text only", ({},)),
}


class EmbeddingRequest(Body):
    model: str | None = Field(default=None, description="an embedding model's name or alias (absent: the pooling "
                              "service's default embedding model)")
    truncate_prompt_tokens: int | None = TRUNCATE_PROMPT_TOKENS
    input: str | Texts | TokenIds | TokenIdLists
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    normalize: bool | None = Field(default=None, description="vLLM's: unit vectors (absent: the model's "
                                   "sentence-transformers config)")
    user: str | None = accepted("not recorded")
    truncate: bool | None = Field(default=None, strict=True, description="TEI's: an input past the model's "
                                  "maximum input length is cut to it instead of refused with 400 (null: false)")
    truncation_direction: Direction | None = Field(
        default=None, description="TEI's: which end `truncate` keeps the tokens of (right, the default: the first ones)")
    refused: ClassVar[dict[str, Refusal]] = {
        **POOLING_REFUSED,
        "add_special_tokens": Refusal("inputs are tokenized with the model's special tokens", (True,)),
        "request_id": Refusal("the embeddings answer carries no id"),
        "embed_dtype": Refusal("embeddings are float32", ("float32",)),
        "endianness": Refusal("base64 embeddings are little-endian float32", ("little",)),
        "messages": Refusal("embeddings take text or token ids in `input`, not chat messages"),
        "chat_template": Refusal("embeddings take text or token ids in `input`, not chat messages"),
        "chat_template_kwargs": Refusal("embeddings take text or token ids in `input`, not chat messages"),
        "add_generation_prompt": Refusal("embeddings take text or token ids in `input`, not chat messages"),
        "continue_final_message": Refusal("embeddings take text or token ids in `input`, not chat messages"),
    }


class RerankRequestDocument(Strict):
    text: str


class RerankRequest(Body):
    """Jina's and Cohere's rerank body (documents: texts or `{"text": ...}` objects), or on POST /rerank
    also TEI's (`texts`, answered as TEI's list of ranks): exactly one of `documents` and `texts`."""

    model: str | None = None
    query: str
    documents: Annotated[list[str | RerankRequestDocument], Field(fail_fast=True)] | None = None
    top_n: Count | None = None
    return_documents: bool = Field(default=True, description="Jina's default (and vLLM's answer): each result "
                                   "carries its document; false leaves it null")
    truncate_prompt_tokens: int | None = Field(default=None, description="vLLM's: -1 as truncate with "
                                               "truncation_direction left; other values are refused")
    activation: bool | None = Field(default=None, description=ACTIVATION)
    use_activation: bool | None = Field(default=None, description=ACTIVATION + " (vLLM's newer name)")
    texts: Texts | None = Field(default=None, description="TEI's name for the documents (POST /rerank only); the "
                                "answer is then TEI's: a list of {index, score, text?}, highest score first")
    return_text: bool = Field(default=False, strict=True, description="TEI's name for return_documents")
    raw_scores: bool = Field(default=False, strict=True,
                             description="TEI's: the cross-encoder's logit instead of its sigmoid")
    truncate: bool | None = Field(default=None, strict=True, description="TEI's: a (query, document) pair past the "
                                  "model's maximum input length is cut to it, the longer side first, instead of "
                                  "refused with 400 (null: false)")
    truncation_direction: Direction = "right"
    refused: ClassVar[dict[str, Refusal]] = {
        **POOLING_REFUSED,
        "rank_fields": Refusal("documents are texts: there are no fields to rank by"),
        "max_chunks_per_doc": Refusal("documents are not chunked: a long one is refused, or cut with truncate"),
        "max_tokens_per_doc": Refusal("documents are cut only to the model's maximum input length (truncate)"),
    }


class ScoreRequest(Body):
    """vLLM's /score body: `text_1` one text scored against each of `text_2`, or two lists of equal
    length scored pairwise (a list of one text counts as one text)."""

    model: str | None = None
    text_1: str | Texts
    text_2: str | Texts
    truncate_prompt_tokens: int | None = Field(default=None, description="vLLM's: -1 as truncate with "
                                               "truncation_direction left; other values are refused")
    truncate: bool | None = Field(default=None, strict=True, description="tessera's (TEI's): a pair past the "
                                  "model's maximum input length is cut to it, the longer side first, instead of "
                                  "refused (null: false)")
    activation: bool | None = Field(default=None, description=ACTIVATION)
    use_activation: bool | None = Field(default=None, description=ACTIVATION + " (vLLM's newer name)")
    refused: ClassVar[dict[str, Refusal]] = dict(POOLING_REFUSED)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{uuid.uuid4().hex}")
    model: str
    results: list[RerankResult]
    usage: Usage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData] = Field(description="one score per pair, in the pairs' order")
    usage: Usage
