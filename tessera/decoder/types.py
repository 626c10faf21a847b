"""The decoder's domain types: what a Generate call asks for (parts, messages, sampling), what
the engine answers (outputs, usage, sampled tokens) and what it reports (`DecoderInfo`,
`EngineStats`). No protobuf here: convert.py maps the wire messages onto these."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tessera.common.errors import InvalidArgument
from tessera.common.limits import MAX_N, MAX_TOP_LOGPROBS

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    """An image after the vision encoder.

    rows: float32 [t*h*w, hidden] in (t, h, w) raster order; grid_thw in LLM units;
    mrope_section: frequency pairs per axis the encoder was built for.
    """

    rows: torch.Tensor
    grid_thw: tuple[int, ...]
    mrope_section: tuple[int, ...]
    content_hash: str = ""


@dataclass(frozen=True)
class RawImagePart:
    """An image that was never encoded (the gateway must send it through vision first)."""


Part = TextPart | ImagePart | RawImagePart


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: tuple[Part, ...]


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy; top_p 0 or 1 and top_k 0 disable the filters.

    Penalties (applied to the logits before temperature and filters, greedy included):
    repetition_penalty as in transformers (tokens of prompt + output; 1 = off), presence and
    frequency penalties as in OpenAI's API (generated tokens only; 0 = off). `n` choices share
    the prompt; choice i draws from seed + i. `logprobs` / `top_logprobs` report the raw model
    distribution. `max_tokens` None generates up to the end of the context (max_model_len less
    the prompt's tokens, as vLLM's OpenAI server; the engine resolves it once the prompt is
    tokenized). Raises InvalidArgument on out-of-range values.
    """

    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # alternatives per prompt token (0..20); None = none

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1 (or unset for the rest of the context), got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0  # dividing logits by ~1e-38 overflows; below vLLM's epsilon is greedy
        if self.seed is not None and self.seed < 0:
            raise InvalidArgument(f"seed must be >= 0, got {self.seed}")
        if not (math.isfinite(self.top_p) and 0 <= self.top_p <= 1):
            raise InvalidArgument(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_p == 0:
            self.top_p = 1.0
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if any(s == "" for s in self.stop):
            raise InvalidArgument("stop strings must not be empty")
        self.stop, self.stop_token_ids = tuple(self.stop), tuple(self.stop_token_ids)
        self._check_penalties_and_choices()

    def _check_penalties_and_choices(self) -> None:
        if self.repetition_penalty == 0:
            self.repetition_penalty = 1.0
        if not 0 < self.repetition_penalty <= 10:
            raise InvalidArgument(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidArgument(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 1 <= self.n <= MAX_N:
            raise InvalidArgument(f"n must be in [1, {MAX_N}], got {self.n}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs:
            self.logprobs = True

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerateInput:
    """Exactly one of `prompt`, `messages`, `prompt_token_ids` is set (checked by the prompt builder).
    `return_prompt`: the first output of each choice carries the prompt's token ids and text."""

    sampling: SamplingParams
    request_id: str = ""
    prompt: tuple[Part, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    lora: str = ""
    return_prompt: bool = False


@dataclass(frozen=True)
class TokenizeInput:
    """What to tokenize: exactly one of `text` and `messages` (text parts only).

    add_special_tokens: None = True for text, False for messages (their chat template holds the
    special tokens), as vLLM's /tokenize. add_generation_prompt: messages only, as Generate renders them.
    """

    text: str = ""
    messages: tuple[ChatMessage, ...] = ()
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


@dataclass(frozen=True)
class Tokenization:
    """Token ids of one TokenizeInput with their vocabulary entries and special flags, and the
    model's context."""

    model: str
    token_ids: list[int]
    tokens: list[str]
    special: list[bool]
    max_model_len: int


@dataclass
class ImageSpan:
    """Projected rows that replace the embeddings of prompt positions [start, start + len(rows))."""

    start: int
    rows: torch.Tensor  # [num_rows, hidden] float32
    content_hash: str = ""  # the vision service's hash of the image bytes and recipe (a claim)
    rows_digest: str = ""  # sha256 of the rows and grid this decoder received (prefix_cache.rows_digest)

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


@dataclass
class PromptInputs:
    """A prompt after image expansion.

    mrope_positions: int64 [3, num_tokens] (t, h, w) or None for a text-only decoder;
    rope_delta: next text rotary position minus physical length (decode position = physical + delta).
    """

    token_ids: list[int]
    image_spans: list[ImageSpan] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None
    rope_delta: int = 0

    @property
    def num_image_tokens(self) -> int:
        return sum(s.rows.shape[0] for s in self.image_spans)


@dataclass
class Sample:
    """One chosen token; `logprob`/`top` are filled only when the request asked for logprobs."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


@dataclass(frozen=True)
class TokenText:
    """A token's text as logprobs report it (`tokenizer.decode([id])`, special tokens kept, as vLLM;
    U+FFFD for part of a character) and its exact bytes (byte-level BPE: the bytes it stands for;
    tessera/decoder/token_text.py)."""

    text: str
    bytes: bytes


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    image_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RequestOutput:
    """What one engine step produced for one request (deltas since the previous output).

    The first output of each choice also carries, when asked, `prompt_logprobs` (one entry per
    prompt token from the second: the first has no context; the same for every choice) and, with
    `return_prompt`, `prompt_token_ids` and `prompt_text` (`tokenizer.decode` of the ids, special
    tokens kept). `token_texts` holds the text and bytes of every id in `logprobs` and
    `prompt_logprobs` (chosen and alternatives); it is empty when neither was asked for.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last output
    usage: Usage | None = None
    logprobs: list[Sample] = field(default_factory=list)  # one per token id when requested
    index: int = 0                    # choice index among the request's n
    prompt_logprobs: list[Sample] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    token_texts: dict[int, TokenText] = field(default_factory=dict)


@dataclass
class EngineStats:
    """The scheduler's and the KV cache's state now (counts of blocks and requests)."""

    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0      # admissions that looked the prefix cache up
    prefix_cache_hits: int = 0         # admissions that reused at least one cached block
    prefix_cache_hit_tokens: int = 0


@dataclass
class DecoderInfo:
    """What a decoder serves and its load now (GetInfo's answer).

    `mrope_section` is empty for a text-only decoder (image parts are refused); `image_token_id`
    is None then. `resident_adapters`: adapter names whose weights sit in a device slot (sorted).
    """

    model: str
    architecture: str
    dtype: str
    max_model_len: int
    vocab_size: int
    hidden_size: int
    block_size: int
    mrope_section: tuple[int, ...]
    image_token_id: int | None
    stats: EngineStats
    resident_adapters: list[str] = field(default_factory=list)
