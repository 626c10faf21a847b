"""text-embeddings-inference's native bodies and answers (its router's http/types.rs): POST /embed
(and /), TEI's rerank answer, GET /info, and TEI's error shape.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from services.gateway.http.fields import Body
from services.gateway.http.protocol import Direction, StrictTokenIdLists, StrictTokenIds, Texts


class TeiEmbedRequest(Body):
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
