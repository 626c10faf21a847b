"""Request and response bodies of the HTTP API, in OpenAI's (and vLLM's, Jina's, Cohere's) shapes.

Only what the gateway can honour is declared; bounds that the gRPC side already enforces (the
gateway's caps, the sampler's ranges) are left to it, so one place states each limit. Fields
OpenAI defines that tessera does not support are declared and refused when set (`echo`), never
silently ignored. Unknown extra fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, Field

# protobuf's int32 fields: a larger number is refused here (400), not by the message setter
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Count = Annotated[int, Field(ge=1, le=2**31 - 1)]
# Lists stop at their first bad item (pydantic's fail_fast): a body of millions of bad items would
# otherwise build an error for each, gigabytes and seconds of the gateway's one event loop.
TokenIds = Annotated[list[Int32], Field(fail_fast=True)]
TokenIdLists = Annotated[list[TokenIds], Field(fail_fast=True)]
Texts = Annotated[list[str], Field(fail_fast=True)]
# TEI's bodies as its router (serde) takes them: no `true` for 1 or "yes" for true
StrictInt32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1, strict=True)]
StrictTokenIds = Annotated[list[StrictInt32], Field(fail_fast=True)]
StrictTokenIdLists = Annotated[list[StrictTokenIds], Field(fail_fast=True)]
Direction = Literal["right", "left", "Right", "Left"]  # TEI's truncation_direction (it takes both spellings)

# OpenAI's documented default for /v1/completions; chat's is the rest of the context, as in
# OpenAI's API and vLLM: 0 on the wire, resolved by the decoder once the prompt is tokenized.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 0


class ImageURL(BaseModel):
    url: str = Field(description="a base64 data URI (data:image/png;base64,...); remote URLs are refused")
    detail: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        description='"developer" is OpenAI\'s newer name for "system", and is sent as one')
    content: str | Annotated[list[TextPart | ImagePart], Field(fail_fast=True)] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling fields chat and completions share (OpenAI's names and ranges)."""

    model: str | None = Field(default=None, description="the decoder's base model name, or a loaded adapter's name "
                              "(absent: the base model, as vLLM)")
    truncate_prompt_tokens: int | None = Field(default=None, description="vLLM's; not supported: refused when set "
                                               "(a prompt past the context is refused)")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: Count | None = None
    stop: str | Texts | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    n: Count = 1
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = Field(default=None, description="only with stream: true")
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(default=None, description="not supported: refused when not empty")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="alternatives per position; "
                                                                          "needs logprobs: true")
    response_format: dict | None = Field(default=None, description='not supported: refused unless {"type": "text"}')
    tools: list | None = Field(default=None, description="not supported: refused when not empty")
    tool_choice: str | dict | None = Field(default=None, description='not supported: refused unless "none"')
    functions: list | None = Field(default=None, description="not supported (deprecated tools): refused when set")
    function_call: str | dict | None = Field(default=None, description="not supported: refused unless \"none\"")


class CompletionRequest(SamplingFields):
    prompt: str | Texts | TokenIds | TokenIdLists = Field(
        description="text, a list of texts, token ids, or a list of token-id lists")
    logprobs: int | None = Field(default=None, ge=0, le=20, description="alternatives per position")
    echo: bool = Field(default=False, description="not supported: refused when true")
    suffix: str | None = Field(default=None, description="not supported: refused when set")
    best_of: int | None = Field(default=None, description="not supported: refused unless absent, 1 or n")


class EmbeddingRequest(BaseModel):
    model: str | None = Field(default=None, description="the pooling service's embedding model name (absent: its "
                              "default embedding model)")
    truncate_prompt_tokens: int | None = Field(default=None, description="vLLM's: -1 cuts an input past the "
                                               "model's maximum input length to its last tokens; other values are "
                                               "refused (see truncate)")
    input: str | Texts | TokenIds | TokenIdLists
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: str | None = None
    truncate: bool | None = Field(default=None, strict=True, description="TEI's: an input past the model's "
                                  "maximum input length is cut to it instead of refused with 400 (null: false)")
    truncation_direction: Direction | None = Field(
        default=None, description="TEI's: which end `truncate` keeps the tokens of (right, the default: the first ones)")


class RerankDocument(BaseModel):
    text: str


class RerankRequest(BaseModel):
    """Jina's and Cohere's rerank body (documents: texts or `{"text": ...}` objects), or on POST /rerank
    also TEI's (`texts`, answered as TEI's list of ranks): exactly one of `documents` and `texts`."""

    model: str | None = None
    query: str
    documents: Annotated[list[str | RerankDocument], Field(fail_fast=True)] | None = None
    top_n: Count | None = None
    return_documents: bool = Field(default=True, description="Jina's default (and vLLM's answer): each result "
                                   "carries its document; false leaves it null")
    truncate_prompt_tokens: int | None = Field(default=None, description="vLLM's: -1 as truncate with "
                                               "truncation_direction left; other values are refused")
    texts: Texts | None = Field(default=None, description="TEI's name for the documents (POST /rerank only); the "
                                "answer is then TEI's: a list of {index, score, text?}, highest score first")
    return_text: bool = Field(default=False, strict=True, description="TEI's name for return_documents")
    raw_scores: bool = Field(default=False, strict=True,
                             description="TEI's: the cross-encoder's logit instead of its sigmoid")
    truncate: bool | None = Field(default=None, strict=True, description="TEI's: a (query, document) pair past the "
                                  "model's maximum input length is cut to it, the longer side first, instead of "
                                  "refused with 400 (null: false)")
    truncation_direction: Direction = "right"


class ScoreRequest(BaseModel):
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


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: exactly one of `prompt` and `messages` (chat: decoder models only)."""

    model: str | None = Field(default=None, description="empty or a pooling model's name: that model's "
                              "tokenizer; the decoder's model or a loaded adapter's name: the decoder's")
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(fail_fast=True)] | None = Field(
        default=None, description="rendered with the decoder's chat template")
    add_special_tokens: bool | None = Field(default=None, description="default true for prompt, false for messages")
    add_generation_prompt: bool = Field(default=True, description="messages only")


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize (decoder models only)."""

    model: str | None = Field(default=None, description="the decoder's model or a loaded adapter's name")
    tokens: TokenIds


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    replace: bool = Field(default=False, strict=True, description="tessera: load new weights under a name already loaded")
    drain: bool = Field(default=False, strict=True, description="tessera: with replace, wait for running requests on the old "
                                                   "weights to end (else 400 while any runs)")


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    drain: bool = Field(default=False, strict=True, description="tessera: refuse new requests and wait for running ones to "
                                                   "end (else 400 while any runs)")


# -- responses ----------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


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


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


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


# -- text-embeddings-inference's native routes (its router's http/types.rs) -----------------------


class TeiEmbedRequest(BaseModel):
    """TEI's /embed body (also POST /, where huggingface_hub's InferenceClient.feature_extraction sends it)."""

    inputs: str | Texts | StrictTokenIds | StrictTokenIdLists = Field(
        description="a text, texts, a token id list or token id lists (special tokens are the client's)")
    normalize: bool = Field(default=True, strict=True, description="TEI's default: unit vectors")
    truncate: bool | None = Field(default=None, strict=True, description="an input past the model's maximum input "
                                  "length is cut to it instead of refused (null: false)")
    truncation_direction: Direction = "right"
    prompt_name: str | None = Field(default=None, description="a key of the model's sentence-transformers prompts")
    dimensions: Annotated[int, Field(ge=1, le=2**31 - 1, strict=True)] | None = Field(
        default=None, description="Matryoshka models only: the first `dimensions`")
    model: str | None = Field(default=None, description="tessera's, not TEI's: which pooling model (TEI serves one; "
                              "default: the pooling service's default embedding model)")


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
