"""Typed results of the client (dataclasses; the protobuf messages stay inside the client).

Counts are tokens unless named otherwise; embeddings are numpy float32 arrays.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# An image part: raw encoded bytes (PNG, JPEG, ...), a file path (pathlib.Path or os.PathLike;
# a plain str inside message content is text), or a PIL.Image.Image (sent as PNG).
ImageLike = bytes | os.PathLike | Any
# Message content: text, or a list of parts: str = text; a dict = an OpenAI content part,
# {"type": "text", "text": ...} or {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}};
# anything else an ImageLike.
Content = str | Sequence[Any]


@dataclass(frozen=True)
class Message:
    """One chat turn. `role` is "system", "user" or "assistant"; images come in `content` as parts
    (see `Content`: the client's own, or OpenAI's dicts); `name`, the participant's name, reaches
    the chat template as the message's `name` (OpenAI's and vLLM's)."""

    role: str
    content: Content
    name: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample (the decoder's SamplingParams). temperature 0 is greedy; top_p 1 and top_k 0
    are off; `seed` makes sampling repeatable; `stop` strings are not returned; `n` choices share
    the prompt's KV blocks; `logprobs` returns each chosen token's log-probability and
    `top_logprobs` (0..20; only with logprobs) alternatives; penalties follow OpenAI (presence, frequency) and
    transformers (repetition, 1 = off). vLLM's extras: `min_p` (0 = off) drops tokens less likely
    than min_p times the likeliest; the first `min_tokens` tokens never end a choice (EOS, stop ids
    and strings); `include_stop_str_in_output` keeps a matched stop string; `skip_special_tokens`
    False keeps special tokens in the text. Token controls: `logit_bias` (OpenAI's: token id -> a
    value in [-100, 100] added to its logit), `allowed_token_ids` (vLLM's: only these ids are
    sampled; empty = all) and `bad_words` (vLLM's: words never generated). Every field is sent as set here, so the model's
    generation-config defaults (which apply to fields a request leaves unset) do not apply to this
    client's requests.

    Structured output, at most one of: `json_schema` (a JSON Schema, a dict or its JSON text),
    `json_object` (any JSON object), `regex` (the whole text matches it), `choice` (the text is one
    of these strings), `grammar` (xgrammar's EBNF, start rule `root`); JSON is compact unless
    `any_whitespace`. The decoder refuses (InvalidArgument naming `sampling.<field>`) a schema
    keyword it cannot enforce or a regex or grammar that does not compile (docs/structured-output.md).

    Raises:
        ValueError: two constraints, or `choice` given as one string.
    """

    max_tokens: int | None = 64  # None: up to the end of the context (max_model_len - prompt tokens)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    allowed_token_ids: Sequence[int] = ()
    bad_words: Sequence[str] = ()
    json_schema: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        stated = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(stated) > 1:
            raise ValueError(f"one structured-output constraint per request, got {', '.join(stated)}")
        if isinstance(self.choice, str):
            raise ValueError(f"choice is a list of strings, got the string {self.choice!r}")


# SamplingParams' structured-output fields (the protobuf's `constraint` oneof)
CONSTRAINTS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    image_tokens: int = 0          # of prompt_tokens, how many were image placeholders
    cached_prompt_tokens: int = 0  # of prompt_tokens, how many came from the prefix cache


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str = ""           # the token's text (tokenizer.decode([id]), as vLLM; U+FFFD for part of a character)
    token_bytes: bytes = b""  # the token's exact UTF-8 bytes


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability (natural log, raw model distribution) of a chosen token and its top
    alternatives; `token` and `token_bytes` as TopLogprob's ("" where the decoder sent none)."""

    token_id: int
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)
    token: str = ""
    token_bytes: bytes = b""


@dataclass(frozen=True)
class GenerateDelta:
    """What one streamed message added to choice `index`: new text and token ids.

    `finish_reason` is "" while the choice runs, then "stop", "length" or "abort".
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class GenerateResult:
    """A finished Generate: every choice (n of them, index order) and the usage.

    `usage` is the request's, as OpenAI and vLLM count n choices: completion_tokens (and
    total_tokens) summed over every choice, the prompt counted once. `text`, `token_ids` and
    `finish_reason` are choice 0's. `replica` is the decoder replica
    that served it (host:port), as the gateway reports it.
    """

    request_id: str
    choices: list[Choice]
    usage: Usage
    replica: str = ""

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason


@dataclass(frozen=True)
class EmbedResult:
    model: str
    embeddings: np.ndarray  # [num_inputs, dimension] float32, input order
    prompt_tokens: int


@dataclass(frozen=True)
class RerankItem:
    index: int          # position in the request's documents
    score: float
    document: str = ""  # set when return_documents


@dataclass(frozen=True)
class RerankResult:
    model: str
    method: str              # "bi-encoder", "cross-encoder" or "llm-judge"
    results: list[RerankItem]  # descending score, ties by index


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    special: bool
    start: int  # character offsets into the input; 0, 0 for special tokens and for decoder models
    stop: int


@dataclass(frozen=True)
class TokenizeResult:
    model: str
    tokens: list[list[Token]]  # one list per input (decoder models: one, without character offsets)
    max_model_len: int = 0     # decoder models: the context in tokens; 0 for pooling models


@dataclass(frozen=True)
class AdapterResidency:
    decoder_id: str
    leases: int


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    digest: str               # sha256 hex over target names and effective (scaled) weights
    rank: int
    target_modules: list[str]
    lora_alpha: float
    use_rslora: bool
    path: str                 # as resolved inside the adapter root
    generation: int           # bumps each time the name is (re)loaded
    state: str                # "ready", "draining"; not servable here: "base_mismatch", "base_unknown"
    residency: list[AdapterResidency] = field(default_factory=list)
    leases: int = 0
    base_model: str = ""      # sha256 hex of the base model's architecture it was registered against ("" = unknown)
    base_model_name: str = ""


@dataclass(frozen=True)
class DecoderInfo:
    model: str
    architecture: str
    max_model_len: int
    vocab_size: int
    hidden_size: int
    block_size: int
    num_blocks: int
    num_free_blocks: int
    mrope_section: list[int]
    image_token_id: int
    num_running: int
    num_waiting: int
    dtype: str
    num_cached_blocks: int
    prefix_cache_hits: int
    prefix_cache_hit_tokens: int
    resident_adapters: list[str]
    served_model_names: list[str] = field(default_factory=list)  # `model` first, then its aliases
    generation_config: str = ""  # --generation-config: "auto", "vllm" or a directory
    # sampling defaults in force for fields a request leaves unset (temperature, top_p, ...); {} under "vllm"
    generation_defaults: dict[str, float] = field(default_factory=dict)
    model_impl: str = ""  # "native" (tessera's model file) or "transformers" (transformers' modeling code)
    decode_step: str = ""  # "fused" (every layer in one C call) or "modules" (layer by layer); "" unknown
    quantization: str = ""  # GGML types kept quantized and the kernels' mode ("Q4_1 exact"); "" dense


@dataclass(frozen=True)
class PoolingModelInfo:
    model: str
    kind: str  # "embedding", "cross-encoder" or "llm-judge"
    pooling_mode: str
    normalize: bool
    dimension: int
    max_input_length: int
    rerank_method: str
    matryoshka_dimensions: list[int]
    matryoshka: bool
    prompts: dict[str, str]
    aliases: list[str] = field(default_factory=list)  # --served-model-name's further names, accepted as `model`


@dataclass(frozen=True)
class PoolingInfo:
    model: str
    pooling_mode: str
    normalize: bool
    dimension: int
    max_input_length: int
    max_batch_size: int
    rerank_method: str
    models: list[PoolingModelInfo]
    max_batch_tokens: int
    max_queue_size: int
    max_wait_ms: float
    dynamic_batching: bool


@dataclass(frozen=True)
class EncoderCacheStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class VisionInfo:
    encoder: str
    revision: str
    output_width: int
    image_size: int
    patch_size: int
    max_image_bytes: int
    max_image_pixels: int
    max_images_per_request: int
    mrope_section: list[int]
    min_pixels: int
    max_pixels: int
    encoder_cache: EncoderCacheStats | None
    images_encoded: int


@dataclass(frozen=True)
class ReplicaInfo:
    service: str            # "decoder" or "pooling"
    address: str
    ready: bool             # connected and its health says SERVING
    state: str              # the gateway's channel state (READY, CONNECTING, TRANSIENT_FAILURE...)
    num_requests: int       # requests the gateway has sent it
    num_outstanding: int    # of those, in flight now
    decoder: DecoderInfo | None  # a decoder replica's last report (queue, KV blocks, adapters)


@dataclass(frozen=True)
class ClusterInfo:
    """The gateway's view. A section is None when its service did not answer (see `unavailable`)."""

    decoder: DecoderInfo | None
    pooling: PoolingInfo | None
    vision: VisionInfo | None
    unavailable: list[str]
    replicas: list[ReplicaInfo]
