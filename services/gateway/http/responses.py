"""Answers of the HTTP API, in OpenAI's (and vLLM's, TEI's, Jina's) shapes; request bodies: models.py."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class TopLogprob(BaseModel):
    token: str = Field(description="the token's text (tokenizer.decode([id]); U+FFFD for part of a character), "
                       "or `token_id:<id>` with return_tokens_as_token_ids")
    logprob: float
    bytes: list[int] | None = Field(default=None, description="the token's exact UTF-8 bytes (OpenAI's)")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one prompt position's token or alternative."""

    logprob: float
    rank: int | None = Field(default=None, description="1 = most likely: the prompt's token's place in the whole "
                             "distribution, an alternative's among the alternatives (vLLM's)")
    decoded_token: str


# vLLM's prompt_logprobs answer: per prompt token, null for the first (it has no context), then
# {token id: PromptLogprob} holding the prompt's own token and the alternatives asked for.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(default=None, description="vLLM's, with prompt_logprobs")


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: one entry per token of the returned text (with echo, the prompt's
    first: its first token's logprob and alternatives null)."""

    text_offset: list[int] = Field(description="each token's character offset in the returned text")
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None] = Field(description="the chosen token and the `logprobs` most "
                                                        "likely alternatives, by their text")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, description="vLLM's, with prompt_logprobs")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


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


class TokenizeResponse(BaseModel):
    model: str
    count: int
    max_model_len: int | None = Field(default=None, description="decoder models: the context in tokens")
    tokens: list[int]
    token_strs: list[str]


class DetokenizeResponse(BaseModel):
    model: str
    prompt: str


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()), description="the answer's time, as vLLM")
    owned_by: str = "tessera"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    generation_config: str | None = Field(default=None, description="tessera's, the base model: the decoder's "
                                          "--generation-config (absent when it does not say)")
    generation_defaults: dict[str, float] | None = Field(
        default=None, description="tessera's, the base model: the sampling defaults for fields a request leaves "
        "out (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens; absent when none)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
    unavailable: list[str] | None = Field(default=None, description="tessera's: set when the adapter registry "
                                          "did not answer; `data` then lists the served base and pooling models, "
                                          "no adapters (absent otherwise)")


class Health(BaseModel):
    """status "ok" (200) while every service has a SERVING replica; `degraded` lists the replicas
    that are not (killed, stopped, wedged), which the gateway routes around meanwhile."""

    status: Literal["ok", "unavailable"]
    not_serving: list[str] = []
    degraded: list[str] = []


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class TeiRank(BaseModel):
    index: int
    text: str | None = Field(default=None, description="with return_text only (absent otherwise)")
    score: float


class TeiEmbeddingModel(BaseModel):
    pooling: str


class TeiClassifierModel(BaseModel):
    id2label: dict[str, str]
    label2id: dict[str, int]


class TeiInfo(BaseModel):
    """TEI's /info, from the pooling service's GetInfo (its default embedding model)."""

    model_id: str
    model_sha: str | None = None
    model_dtype: str = "float32"
    served_model_name: str
    model_type: dict[Literal["embedding", "reranker"], TeiEmbeddingModel | TeiClassifierModel] = Field(
        description='one key, as TEI\'s externally tagged enum: {"embedding": {"pooling": "mean"}} or {"reranker": ...}')
    max_concurrent_requests: int = Field(description="tessera: the pooling queue's size in sequences")
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None = None
    max_client_batch_size: int
    auto_truncate: bool = Field(default=False, description="a request without `truncate` is refused when too long")
    tokenization_workers: int = 1
    version: str
    sha: str | None = None
    docker_label: str | None = None


class TeiErrorResponse(BaseModel):
    """TEI's refusal: the message, and one of TEI's error types."""

    error: str
    error_type: Literal["validation", "overloaded", "unhealthy", "backend"]


class ErrorResponse(BaseModel):
    error: ErrorBody
