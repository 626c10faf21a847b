"""The decoder's domain types: what a Generate call asks for (parts, messages, sampling), what
the engine answers (outputs, usage, sampled tokens) and what it reports (`DecoderInfo`,
`EngineStats`). No protobuf here: convert.py maps the wire messages onto these."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.errors import InvalidArgument
from services.common.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_TOP_LOGPROBS,
)
from services.decoder.constraints import Constraint

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# OpenAI's range of a logit_bias value.
MAX_ABS_LOGIT_BIAS = 100.0


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
class ToolCall:
    """A function call an assistant message made (OpenAI's tool_calls entry, type "function").
    `arguments`: the call's arguments as a JSON object; the chat template gets them as a dict
    (transformers' tool-use convention; vLLM json.loads OpenAI's string the same way)."""

    id: str
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn; `name` (the participant's, "" = none) reaches the template as message["name"], as vLLM.
    `tool_call_id` (role "tool": the call it answers) and `tool_calls` (role "assistant": the calls
    it made) reach it as message["tool_call_id"] and message["tool_calls"], when set."""

    role: str
    content: tuple[Part, ...]
    name: str = ""
    tool_call_id: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy; top_p 0 or 1, top_k 0 or -1 and min_p 0 disable
    the filters.

    Penalties (applied to the logits before temperature and filters, greedy included):
    repetition_penalty as in transformers (tokens of prompt + output; 1 = off), presence and
    frequency penalties as in OpenAI's API (generated tokens only; 0 = off). After temperature,
    min_p drops tokens whose probability is below min_p times the most likely one's (vLLM's order:
    min_p, then top-k, then top-p). `n` choices share the prompt; choice i draws from seed + i
    (any int: a negative seed is taken modulo 2**64, as torch and vLLM take it; sampler.make_generator).
    `logprobs` / `top_logprobs` report the raw model distribution; `prompt_logprobs` (None = none)
    asks the same of every prompt token from the second.

    Ending (as vLLM): a choice ends with "stop" at a stop string, a `stop_token_ids` entry or one of
    the model's EOS ids (unless `ignore_eos`), none of which ends it before it has `min_tokens`
    tokens: until then the logits of `stop_token_ids` and of the EOS ids (even with ignore_eos) are
    masked, and stop strings are not looked for. `eos_token_ids`: the served model's EOS ids, filled
    in by the engine at submission. `max_tokens` None generates up to the served model's default
    (generation_config.json's max_new_tokens under --generation-config auto) or else the end of the
    context (max_model_len less the prompt's tokens, as vLLM's OpenAI server), either capped by the
    context; the engine resolves it once the prompt is tokenized.

    Token controls (applied to the logits before penalties and temperature, greedy included, in
    vLLM v1's order: sampler.adjusted_scores): `allowed_token_ids` (vLLM's; None = every id, else a
    non-empty set) masks every other id; `bad_words` (vLLM's) are never generated: the engine
    tokenizes each at submission into `bad_words_token_ids` (tokens.bad_words_token_ids), and a
    sequence's last token is masked wherever the output ends with the rest of it; `logit_bias`
    (OpenAI's: token id -> a value in [-100, 100]) is added to those ids' logits. At most
    MAX_LOGIT_BIAS, MAX_ALLOWED_TOKEN_IDS and MAX_BAD_WORDS entries, MAX_BAD_WORD_CHARS characters a
    word (services/common/limits.py); ids past the vocabulary are refused by the engine.

    Structured output: `constraint` (services/decoder/constraints.py; None = free text) masks,
    before the token controls, every token its grammar does not allow next (services/decoder/
    grammar.py); the choice ends with "stop" once the grammar is complete and a stop token taken,
    ignore_eos or not. A constraint takes no `min_tokens` (the grammar decides where the text ends).

    Text: a matched stop string is cut from `text` with all that follows, or kept when
    `include_stop_str_in_output` (the ending stop token's text is kept then too). Special tokens are
    left out of `text` unless `skip_special_tokens` is False; `spaces_between_special_tokens` is
    passed to the tokenizer's decode, where only slow (Python) tokenizers act on it (transformers'
    fast tokenizers ignore it, as vLLM documents).

    Raises InvalidArgument on out-of-range values, naming the field, the value and the limit.
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
    min_p: float = 0.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    constraint: Constraint | None = None
    eos_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1 (or unset for the rest of the context), got {self.max_tokens}",
                                  field="max_tokens")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {self.temperature}",
                                  field="temperature")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0  # dividing logits by ~1e-38 overflows; below vLLM's epsilon is greedy
        self._check_filters()
        if any(s == "" for s in self.stop):
            raise InvalidArgument("stop strings must not be empty", field="stop")
        self.stop, self.stop_token_ids = tuple(self.stop), tuple(self.stop_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)
        if self.min_tokens < 0:
            raise InvalidArgument(f"min_tokens must be >= 0, got {self.min_tokens}", field="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidArgument(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                                  field="min_tokens")
        self._check_penalties_and_choices()
        self._check_token_controls()
        if self.constraint is not None and self.min_tokens:
            raise InvalidArgument(f"min_tokens ({self.min_tokens}) cannot be combined with {self.constraint.field}: "
                                  "the grammar decides where the text ends", field="min_tokens")

    def _check_filters(self) -> None:
        if not (math.isfinite(self.top_p) and 0 <= self.top_p <= 1):
            raise InvalidArgument(f"top_p must be in [0, 1], got {self.top_p}", field="top_p")
        if self.top_p == 0:
            self.top_p = 1.0
        if self.top_k < -1:
            raise InvalidArgument(f"top_k must be >= 0 (0 or -1 = disabled), got {self.top_k}", field="top_k")
        if self.top_k == -1:
            self.top_k = 0  # vLLM's "disabled"
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")

    def _check_penalties_and_choices(self) -> None:
        if self.repetition_penalty == 0:
            self.repetition_penalty = 1.0
        if not 0 < self.repetition_penalty <= 10:
            raise InvalidArgument(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
                                  field="repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidArgument(f"{name} must be in [-2, 2], got {getattr(self, name)}", field=name)
        if not 1 <= self.n <= MAX_N:
            raise InvalidArgument(f"n must be in [1, {MAX_N}], got {self.n}", field="n")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                                  field="top_logprobs")
        if self.top_logprobs:
            self.logprobs = True
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (or unset), "
                                  f"got {self.prompt_logprobs}", field="prompt_logprobs")

    def _check_token_controls(self) -> None:
        self.logit_bias = {int(token): float(value) for token, value in self.logit_bias.items()}
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(f"logit_bias has {len(self.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS}",
                                  field="logit_bias")
        for token, value in self.logit_bias.items():
            if token < 0:
                raise InvalidArgument(f"logit_bias holds token id {token}; token ids are >= 0", field="logit_bias")
            if not (math.isfinite(value) and -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS):
                raise InvalidArgument(f"logit_bias[{token}] must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                                      f"{MAX_ABS_LOGIT_BIAS:g}], got {value}", field="logit_bias")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = tuple(self.allowed_token_ids)
            if not self.allowed_token_ids:  # vLLM refuses an empty list too: nothing could be sampled
                raise InvalidArgument("allowed_token_ids must not be empty (leave it unset to allow every token)",
                                      field="allowed_token_ids")
            if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
                raise InvalidArgument(f"allowed_token_ids has {len(self.allowed_token_ids)} ids; the limit is "
                                      f"{MAX_ALLOWED_TOKEN_IDS}", field="allowed_token_ids")
            if min(self.allowed_token_ids) < 0:
                raise InvalidArgument(f"allowed_token_ids holds {min(self.allowed_token_ids)}; token ids are >= 0",
                                      field="allowed_token_ids")
        self.bad_words = tuple(self.bad_words)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidArgument(f"bad_words has {len(self.bad_words)} words; the limit is {MAX_BAD_WORDS}",
                                  field="bad_words")
        for index, word in enumerate(self.bad_words):
            if not word.strip():  # vLLM strips the leading space before tokenizing: nothing would be left
                raise InvalidArgument(f"bad_words[{index}] is {word!r}; a bad word must hold a non-space character",
                                      field="bad_words")
            if len(word) > MAX_BAD_WORD_CHARS:
                raise InvalidArgument(f"bad_words[{index}] has {len(word)} characters; the limit is "
                                      f"{MAX_BAD_WORD_CHARS}", field="bad_words")
        self.bad_words_token_ids = tuple(tuple(ids) for ids in self.bad_words_token_ids)

    @property
    def adjusts_logits(self) -> bool:
        """True when a token control asks for a change of this request's logits (min_tokens aside)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def min_tokens_masked_ids(self) -> tuple[int, ...]:
        """The ids whose logits are masked until the choice has `min_tokens` tokens (vLLM's
        all_stop_token_ids: stop_token_ids and the EOS ids, ignore_eos or not)."""
        return self.stop_token_ids + self.eos_token_ids


# generation_config.json's fields the defaults take (vLLM's get_diff_sampling_param) -> SamplingParams'
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling values for fields a request leaves unset (vLLM's --generation-config): a
    checkpoint's generation_config.json values, None where it has none. A None field takes its
    neutral value (SamplingParams' default; temperature: the request's default_temperature, else
    greedy; max_tokens: the rest of the context)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config.json's max_new_tokens

    @classmethod
    def from_generation_config(cls, raw: Mapping[str, Any], where: str) -> GenerationDefaults:
        """The defaults in generation_config.json's mapping `raw` (keys absent or null are unset;
        others, such as do_sample, are not sampling defaults: vLLM reads these six too).

        Raises:
            ValueError: a value that is not a number, or out of SamplingParams' range; the message
                names `where` (the file), the key and the value.
        """
        values = {}
        for key, name in GENERATION_CONFIG_FIELDS.items():
            value = raw.get(key)
            if value is None:
                continue
            integral = name in ("top_k", "max_tokens")
            if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
                kind = "an integer" if integral else "a number"
                raise ValueError(f"{where}: {key} must be {kind}, got {value!r}")
            values[name] = value
        try:
            SamplingParams(**values)
        except InvalidArgument as error:
            raise ValueError(f"{where}: {error}") from None
        return cls(**values)

    def as_dict(self) -> dict[str, float]:
        """The set fields by name (max_tokens for max_new_tokens), as DecoderInfo reports them."""
        return {name: float(value) for name, value in vars(self).items() if value is not None}


# apply_chat_template's own arguments (transformers 5): not template variables, so refused as
# chat_template_kwargs keys. `messages` is the template's conversation variable; `documents` is
# both an argument and the variable of the same name, so it is taken.
CHAT_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How chat messages are rendered: transformers' apply_chat_template arguments, as vLLM's chat
    request takes them. `continue_final_message` leaves the last message (the assistant's) open for
    the model to go on, and needs add_generation_prompt False (as transformers). `template_kwargs`:
    further template variables (e.g. `documents`, `enable_thinking`). `tools`: OpenAI tool objects
    ({"type": "function", "function": {name, description, parameters}}, checked by
    services/decoder/tools.py), given to the template as apply_chat_template's `tools`; () = none.

    Raises InvalidArgument: both add_generation_prompt and continue_final_message, or a
    template_kwargs key that is one of apply_chat_template's own arguments (`tools` is the
    request's own field).
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tools: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidArgument("add_generation_prompt and continue_final_message cannot both be true: "
                                  "continue the final message, or open a new assistant turn",
                                  field="add_generation_prompt")
        for key in self.template_kwargs:
            if key == "tools":
                raise InvalidArgument("chat_template_kwargs key 'tools' is refused: send the tools as the "
                                      "request's own `tools` field", field="chat_template_kwargs")
            if key in CHAT_TEMPLATE_ARGUMENTS:
                raise InvalidArgument(f"chat_template_kwargs key {key!r} is refused: it is an argument of "
                                      "apply_chat_template, not a template variable", field="chat_template_kwargs")

    @property
    def is_default(self) -> bool:
        """True for the rendering every message request gets unless it asks otherwise."""
        return self == ChatTemplateOptions()


@dataclass
class GenerateInput:
    """Exactly one of `prompt`, `messages`, `prompt_token_ids` is set (checked by the prompt builder).
    `return_prompt`: the first output of each choice carries the prompt's token ids and text.
    `chat` applies to `messages` (other prompts refuse options other than the default)."""

    sampling: SamplingParams
    request_id: str = ""
    prompt: tuple[Part, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    lora: str = ""
    return_prompt: bool = False
    chat: ChatTemplateOptions = field(default_factory=ChatTemplateOptions)


@dataclass(frozen=True)
class TokenizeInput:
    """What to tokenize: exactly one of `text` and `messages` (text parts only).

    add_special_tokens: None = True for text, False for messages (their chat template holds the
    special tokens), as vLLM's /tokenize. `chat`: messages only, rendered as Generate renders them.
    """

    text: str = ""
    messages: tuple[ChatMessage, ...] = ()
    add_special_tokens: bool | None = None
    chat: ChatTemplateOptions = field(default_factory=ChatTemplateOptions)


@dataclass(frozen=True)
class PromptTokenCount:
    """A prompt's tokens before its images are encoded: `num_text_tokens` counts every token but the
    images' placeholder tokens (text, chat template, vision start/end); `max_model_len` the context."""

    num_text_tokens: int
    num_images: int
    max_model_len: int


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
    """One chosen token; `logprob`/`top` are filled only when the request asked for logprobs;
    `rank` (prompt logprobs) is the token's place in the whole distribution: how many tokens are at
    least as likely, itself included (1 = most likely; vLLM's rank, ties counted as it counts them)."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first
    rank: int | None = None


@dataclass(frozen=True)
class TokenText:
    """A token's text as logprobs report it (`tokenizer.decode([id])`, special tokens kept, as vLLM;
    U+FFFD for part of a character) and its exact bytes (byte-level BPE: the bytes it stands for;
    services/decoder/token_text.py)."""

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
    """The engine's state now, taken at once: the scheduler's and the KV cache's counts of blocks
    and requests, the prefix cache's and the adapters' counters since start, and the adapters of
    the running and waiting requests at the last scheduling step (GetInfo's and the metrics')."""

    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0      # admissions that looked the prefix cache up
    prefix_cache_hits: int = 0         # admissions that reused at least one cached block
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0  # prompt tokens looked up
    num_adapter_swaps: int = 0          # adapters written into a device slot
    num_adapter_host_cache_hits: int = 0
    num_adapter_weight_fetches: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    lora_updated_s: float = 0.0         # wall-clock seconds of the adapter lists' last update


@dataclass
class DecoderInfo:
    """What a decoder serves and its load now (GetInfo's answer).

    `mrope_section` is empty for a text-only decoder (image parts are refused); `image_token_id`
    is None then. `resident_adapters`: adapter names whose weights sit in a device slot (sorted).
    `model` is the first of `served_model_names` (--served-model-name); `generation_config` the
    --generation-config value and `generation_defaults` the defaults in force (GenerationDefaults.as_dict).
    `chat_template_takes_tools`: the chat template renders a `tools` list; `tool_call_parser`: the
    format the model's tool calls are parsed from ("hermes"; "" = none), services/decoder/tools.py.
    `model_impl`: how the model runs, "native" or "transformers" (DecoderConfig.model_impl);
    `decode_step`: how all-decode steps run, "fused" or "modules" (DecoderConfig.decode_step resolved).
    `quantization`: the GGML types of the matrices kept quantized and the kernels' mode ("Q4_1 exact";
    quantized_model.py `quantization`), "" for a dense model.
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
    served_model_names: tuple[str, ...] = ()
    generation_config: str = ""
    generation_defaults: dict[str, float] = field(default_factory=dict)
    chat_template_takes_tools: bool = False
    tool_call_parser: str = ""
    model_impl: str = ""
    decode_step: str = ""
    quantization: str = ""
