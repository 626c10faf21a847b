"""Typed requests and results of the pooling core (no gRPC types here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.pooling.tokens import Token


@dataclass(frozen=True)
class EmbedQuery:
    """One Embed request.

    Attributes:
        texts: the inputs as text (exactly one of `texts` / `token_ids` is non-empty).
        token_ids: pre-tokenized inputs, special tokens included.
        normalize: unit-normalize; None = the model's default.
        model: "" (the default embedding model) or a served model name.
        truncate: cut inputs past max_input_length instead of refusing them.
        truncation_direction: "right" keeps the first tokens, "left" the last.
        dimensions: Matryoshka width (first `dimensions` components, then normalized), or None.
        prompt_name: a prompt of the model's sentence-transformers config, "" = its default prompt.
    """

    texts: tuple[str, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()
    normalize: bool | None = None
    model: str = ""
    truncate: bool = False
    truncation_direction: str = "right"
    dimensions: int | None = None
    prompt_name: str = ""


@dataclass(frozen=True)
class Embeddings:
    """Embed output: `vectors` [N, D] float32 CPU in input order; `num_prompt_tokens` excludes padding."""

    model: str
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

    model: str
    results: list[RankedDocument]
    method: str
    num_prompt_tokens: int


@dataclass(frozen=True)
class Tokenization:
    """Tokenize output: one token list per input."""

    model: str
    results: list[list[Token]]


@dataclass(frozen=True)
class ModelInfo:
    model: str
    kind: str
    pooling_mode: str
    normalize: bool
    dimension: int
    max_input_length: int
    rerank_method: str
    matryoshka: bool
    matryoshka_dimensions: tuple[int, ...]
    prompts: dict[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()  # further names requests may give (answers carry `model`)


@dataclass(frozen=True)
class PoolingInfo:
    """The default model's fields (what a single-model client reads), every model, and the batching limits."""

    model: str
    pooling_mode: str
    normalize: bool
    dimension: int
    max_input_length: int
    max_batch_size: int
    rerank_method: str
    models: list[ModelInfo]
    max_batch_tokens: int
    max_queue_size: int
    max_wait_ms: float
    dynamic_batching: bool
