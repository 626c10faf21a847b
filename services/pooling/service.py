"""The pooling core: validated embedding and rerank requests over one encoder (no gRPC types here).

One device forward at a time: an asyncio lock admits one request's batch, and the forward runs in
a worker thread (`asyncio.to_thread`) so the event loop keeps answering health checks and
validating other requests meanwhile. Tokenization also runs in a thread, outside the lock.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument, NotFound, Unavailable
from services.pooling.config import PoolingConfig
from services.pooling.encoder import HFEncoder, TokenizedBatch
from services.pooling.pooling import normalize as unit_normalize
from services.pooling.pooling import pool

# With no trained cross-encoder head, rerank scores are cosine similarities of normalized
# embeddings, as vLLM's score API does for embedding models.
BI_ENCODER = "bi-encoder"


@dataclass(frozen=True)
class Embeddings:
    """Embed output: `vectors` [N, D] float32 CPU in input order; `num_prompt_tokens` excludes padding."""

    vectors: torch.Tensor
    num_prompt_tokens: int


@dataclass(frozen=True)
class RankedDocument:
    """One rerank result: `index` into the request's documents; `document` is set when asked for."""

    index: int
    score: float
    document: str | None = None


@dataclass(frozen=True)
class Ranking:
    """Rerank output: results by descending score (ties by index), at most top_n of them."""

    results: list[RankedDocument]
    method: str
    num_prompt_tokens: int


@dataclass(frozen=True)
class ServiceInfo:
    model: str
    pooling_mode: str
    normalize: bool
    dimension: int
    max_input_length: int
    max_batch_size: int
    rerank_method: str


class PoolingService:
    """Embeddings and bi-encoder rerank for one served model.

    Call `load()` (blocking; the server runs it in a thread before reporting SERVING) or pass a
    ready `encoder`. Requests before that raise `Unavailable`.
    """

    def __init__(self, config: PoolingConfig, encoder: HFEncoder | None = None):
        self.config = config
        self.encoder = encoder
        self._lock = asyncio.Lock()

    def load(self) -> None:
        """Load the encoder named by the config (seconds; blocking)."""
        if self.encoder is None:
            self.encoder = HFEncoder(self.config.model_dir, self.config.max_input_length,
                                     self.config.device, self.config.do_lower_case)

    def info(self) -> ServiceInfo:
        encoder = self._ready()
        return ServiceInfo(
            model=self.config.model_name, pooling_mode=self.config.pooling_mode, normalize=self.config.normalize,
            dimension=encoder.dimension, max_input_length=self.config.max_input_length,
            max_batch_size=self.config.max_batch_size, rerank_method=BI_ENCODER)

    async def embed(self, texts: list[str], normalize: bool | None = None, model: str = "") -> Embeddings:
        """Embed `texts` in one forward.

        Args:
            texts: 1..max_batch_size non-empty strings.
            normalize: unit-normalize; None = the model's default (its Normalize module).
            model: "" or the served model name.

        Raises:
            NotFound: another model name.
            InvalidArgument: no inputs, an empty input, more than max_batch_size inputs, or an
                input longer than max_input_length tokens.
            Unavailable: the encoder is not loaded yet.
        """
        self._check_model(model)
        self._check_texts(texts, "inputs")
        batch = await asyncio.to_thread(self._ready().tokenize, list(texts))
        vectors = await self._forward(batch, self.config.normalize if normalize is None else normalize)
        return Embeddings(vectors=vectors, num_prompt_tokens=sum(batch.num_tokens))

    async def rerank(self, query: str, documents: list[str], top_n: int | None = None,
                     return_documents: bool = False, model: str = "") -> Ranking:
        """Score each document against `query`: cosine of their normalized embeddings.

        The query and the documents go through one forward (max_batch_size documents + the query).

        Args:
            top_n: results to return, 1..len(documents); None = all.

        Raises:
            NotFound: another model name.
            InvalidArgument: empty query, no documents, an empty document, more than
                max_batch_size documents, top_n out of range, an input past max_input_length.
            Unavailable: the encoder is not loaded yet.
        """
        self._check_model(model)
        if not query:
            raise InvalidArgument("query must be a non-empty string")
        self._check_texts(documents, "documents")
        if top_n is not None and not 1 <= top_n <= len(documents):
            raise InvalidArgument(f"top_n must be between 1 and the number of documents ({len(documents)}), got {top_n}")
        labels = ["query", *(f"document {i}" for i in range(len(documents)))]
        batch = await asyncio.to_thread(self._ready().tokenize, [query, *documents], labels)
        vectors = await self._forward(batch, normalize=True)  # [1 + N, D], unit rows
        scores = (vectors[1:] @ vectors[0]).tolist()  # [N] cosine similarities
        order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))
        results = [RankedDocument(index=i, score=scores[i], document=documents[i] if return_documents else None)
                   for i in order[:top_n]]
        return Ranking(results=results, method=BI_ENCODER, num_prompt_tokens=sum(batch.num_tokens))

    async def _forward(self, batch: TokenizedBatch, normalize: bool) -> torch.Tensor:
        async with self._lock:
            return await asyncio.to_thread(self._encode, batch, normalize)

    def _encode(self, batch: TokenizedBatch, normalize: bool) -> torch.Tensor:
        """Forward + pool (+ normalize): [B, D] float32 on CPU."""
        hidden = self._ready().hidden_states(batch)  # [B, T, H]
        mask = batch.attention_mask.to(hidden.device)  # [B, T]
        pooled = pool(hidden, mask, self.config.pooling_mode)  # [B, H] fp32
        return (unit_normalize(pooled) if normalize else pooled).cpu()

    def _check_model(self, model: str) -> None:
        if model and model != self.config.model_name:
            raise NotFound(f"model {model!r} is not served here; this pooling service serves {self.config.model_name!r}")

    def _check_texts(self, texts: list[str], what: str) -> None:
        if not texts:
            raise InvalidArgument(f"{what} is empty; send at least one text")
        if len(texts) > self.config.max_batch_size:
            raise InvalidArgument(f"request has {len(texts)} {what}; max_batch_size is {self.config.max_batch_size}")
        for index, text in enumerate(texts):
            if not text:
                raise InvalidArgument(f"{what}[{index}] is an empty string; every input must hold text")

    def _ready(self) -> HFEncoder:
        if self.encoder is None:
            raise Unavailable("the pooling model is still loading")
        return self.encoder
