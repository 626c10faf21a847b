"""Request caps: every client-supplied string, list and bytes field has one, checked before any work.

A cap is refused as `InvalidArgument` naming the field, its size and the limit with the flag that
sets it ("request_id has 3000000 characters; the limit is 256 (--max-name-chars)"). The checks
read the protobuf message as it arrived, before conversion copies anything, so a refused request
costs its parse and nothing more.

`GenerateLimits` are the caps of one Generate request. The gateway and the decoder hold the same
dataclass (each from its own flags) and run the same `check_generate`: the gateway so that a
request the decoder would refuse never has its images encoded, the decoder because its port
trusts no caller. Each cap is a flag of the same name (services/common/config_cli.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config_cli import flag
from services.common.errors import InvalidArgument
from tessera.protocol import OVER_LIMIT

# Sampling bounds the sampler is built and tested for; a flag may lower them, never raise them.
MAX_N = 16
MAX_TOP_LOGPROBS = 20
# Token controls (SamplingParams.logit_bias, allowed_token_ids, bad_words): entries per request.
# OpenAI documents no count for logit_bias, vLLM none for any of them; these bound the Python work
# per step (bad_words: each word gives up to two token sequences, compared with the output's tail).
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 262144  # above any served vocabulary (Gemma's is 262144)
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
# Structured output (SamplingParams.constraint): characters of its schema, regex, grammar or choices
# together. vLLM sets none; llguidance reports schemas of up to 4 MB compiling. A compile is bounded
# in time as well (the decoder's --structured-outputs-compile-timeout).
MAX_CONSTRAINT_CHARS = 4 * 1024 * 1024
# A BPE token of real text spans a few characters (~4 in English; runs of spaces or symbols merge
# into longer ones). A prompt with more characters than this many per context token cannot fit the
# context, so it is refused before the tokenizer spends time on it (bench/results/settings.md).
CHARS_PER_CONTEXT_TOKEN = 32


def _cap(default: int, help_text: str):
    """A request cap: an int config field with its flag's help (services/common/config_cli.py)."""
    return field(default=default, metadata={"help": help_text})


def check_chars(field: str, value: str, limit: int, setting: str) -> None:
    """Raises InvalidArgument (naming `field`, a protobuf path) when `value` has more than `limit` characters."""
    if len(value) > limit:
        raise InvalidArgument(f"{field} has {len(value)} characters; the limit is {limit} ({flag(setting)})",
                              reason=OVER_LIMIT, field=field)


def check_count(field: str, count: int, limit: int, setting: str, unit: str = "entries", *,
                one_field: bool = True) -> None:
    """Raises InvalidArgument when a list field holds more than `limit` items (`unit` names them);
    it names `field` as the one to blame unless `one_field` is false (a count over several)."""
    if count > limit:
        raise InvalidArgument(f"{field} has {count} {unit}; the limit is {limit} ({flag(setting)})",
                              reason=OVER_LIMIT, field=field if one_field else None)


def check_positive(owner: object, names: tuple[str, ...]) -> None:
    """For config `__post_init__`: raises ValueError naming the first field below 1."""
    for name in names:
        value = getattr(owner, name)
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class GenerateLimits:
    """Caps on one Generate request (gateway and decoder).

    Attributes:
        max_name_chars: request_id, lora (adapter name) and each chat message's role.
        max_prompt_chars: characters of text over every prompt part and chat message together
            (tool calls and the tools' JSON included: the template renders them);
            0 = CHARS_PER_CONTEXT_TOKEN x the decoder's context (262144 for 8192 tokens).
        max_messages: chat messages.
        max_content_parts: content parts over the prompt and every message together.
        max_images: image parts (raw or encoded) per request.
        max_stop: stop strings; max_stop_chars: characters of each one.
        max_stop_token_ids: entries of stop_token_ids.
        max_logit_bias: entries of logit_bias (at most MAX_LOGIT_BIAS); max_allowed_token_ids:
            entries of allowed_token_ids (at most MAX_ALLOWED_TOKEN_IDS); max_bad_words: bad_words
            (at most MAX_BAD_WORDS); max_bad_word_chars: characters of each (at most MAX_BAD_WORD_CHARS).
        max_n: choices per request (1..MAX_N); max_logprobs: top_logprobs and prompt_logprobs
            (0..MAX_TOP_LOGPROBS; vLLM's --max-logprobs caps both).
    prompt_token_ids and the images' expanded tokens are capped by the decoder's context itself.

    Raises:
        ValueError: a cap below 1 (max_prompt_chars below 0), or max_n / max_logprobs past the
            sampler's bounds (MAX_N, MAX_TOP_LOGPROBS and the token controls' MAX_*).
    """

    max_name_chars: int = _cap(256, "characters of request_id, lora and each message's role")
    max_prompt_chars: int = _cap(0, "characters of prompt text over every part and message; "
                                    f"0 = {CHARS_PER_CONTEXT_TOKEN} x the decoder's context")
    max_messages: int = _cap(1024, "chat messages per request")
    max_content_parts: int = _cap(1024, "content parts over the prompt and every message")
    max_images: int = _cap(8, "image parts per request")
    max_stop: int = _cap(16, "stop strings per request")
    max_stop_chars: int = _cap(1024, "characters of each stop string")
    max_stop_token_ids: int = _cap(256, "entries of stop_token_ids")
    max_logit_bias: int = _cap(MAX_LOGIT_BIAS, f"entries of logit_bias (at most {MAX_LOGIT_BIAS})")
    max_allowed_token_ids: int = _cap(MAX_ALLOWED_TOKEN_IDS,
                                      f"entries of allowed_token_ids (at most {MAX_ALLOWED_TOKEN_IDS})")
    max_bad_words: int = _cap(MAX_BAD_WORDS, f"bad_words per request (at most {MAX_BAD_WORDS})")
    max_bad_word_chars: int = _cap(MAX_BAD_WORD_CHARS, f"characters of each bad word (at most {MAX_BAD_WORD_CHARS})")
    max_constraint_chars: int = _cap(1024 * 1024, "characters of a structured-output constraint: its JSON schema, "
                                     f"regex, grammar or choices together (at most {MAX_CONSTRAINT_CHARS})")
    max_n: int = _cap(MAX_N, f"choices per request (at most {MAX_N})")
    max_logprobs: int = _cap(MAX_TOP_LOGPROBS, f"top_logprobs and prompt_logprobs per token (at most {MAX_TOP_LOGPROBS})")

    def __post_init__(self) -> None:
        check_positive(self, ("max_name_chars", "max_messages", "max_content_parts", "max_images", "max_stop",
                              "max_stop_chars", "max_stop_token_ids", "max_logit_bias", "max_allowed_token_ids",
                              "max_bad_words", "max_bad_word_chars", "max_constraint_chars", "max_n"))
        for name, ceiling in (("max_logit_bias", MAX_LOGIT_BIAS), ("max_allowed_token_ids", MAX_ALLOWED_TOKEN_IDS),
                              ("max_bad_words", MAX_BAD_WORDS), ("max_bad_word_chars", MAX_BAD_WORD_CHARS),
                              ("max_constraint_chars", MAX_CONSTRAINT_CHARS)):
            if getattr(self, name) > ceiling:
                raise ValueError(f"{name} must be in 1..{ceiling}, got {getattr(self, name)}")
        if self.max_prompt_chars < 0:
            raise ValueError(f"max_prompt_chars must be >= 0 (0 = {CHARS_PER_CONTEXT_TOKEN} x the context), "
                             f"got {self.max_prompt_chars}")
        if self.max_n > MAX_N:
            raise ValueError(f"max_n must be in 1..{MAX_N}, got {self.max_n}")
        if not 0 <= self.max_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"max_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.max_logprobs}")

    def prompt_chars(self, max_model_len: int | None) -> int | None:
        """The prompt character cap for a decoder of context `max_model_len` (None: unknown, no
        derived cap)."""
        if self.max_prompt_chars:
            return self.max_prompt_chars
        return None if max_model_len is None else CHARS_PER_CONTEXT_TOKEN * max_model_len


def check_generate(request, limits: GenerateLimits, max_model_len: int | None) -> None:
    """Every cap of a `tessera.v1.GenerateRequest`, before tokenizing, encoding or copying tensors.

    `max_model_len`: the decoder's context in tokens, or None where it is not known (then the
    checks that need it are left to the decoder). Raises InvalidArgument for the first cap passed.
    """
    check_chars("request_id", request.request_id, limits.max_name_chars, "max_name_chars")
    check_chars("lora", request.lora, limits.max_name_chars, "max_name_chars")
    _check_sampling(request.sampling, limits, max_model_len)
    check_count("messages", len(request.messages), limits.max_messages, "max_messages", "messages")
    num_parts = len(request.prompt) + sum(len(message.content) for message in request.messages)
    check_count("prompt and messages", num_parts, limits.max_content_parts, "max_content_parts", "content parts",
                one_field=False)
    parts = list(request.prompt)
    for index, message in enumerate(request.messages):
        check_chars(f"messages[{index}].role", message.role, limits.max_name_chars, "max_name_chars")
        parts.extend(message.content)
    kinds = [part.WhichOneof("part") for part in parts]
    num_images = sum(kind in ("image", "encoded_image") for kind in kinds)
    check_count("prompt and messages", num_images, limits.max_images, "max_images", "images", one_field=False)
    cap = limits.prompt_chars(max_model_len)
    if cap is not None:
        chars = sum(len(part.text) for part in request.prompt if part.WhichOneof("part") == "text")
        chars += len(request.tools) + sum(message_chars(message) for message in request.messages)
        if chars > cap:
            raise InvalidArgument(f"prompt text has {chars} characters; the limit is {cap} "
                                  f"({flag('max_prompt_chars')}; default {CHARS_PER_CONTEXT_TOKEN} per context token)")
    if max_model_len is not None:
        _check_context(request, parts, max_model_len)


def _check_sampling(sampling, limits: GenerateLimits, max_model_len: int | None) -> None:
    check_count("sampling.stop", len(sampling.stop), limits.max_stop, "max_stop", "strings")
    for index, stop in enumerate(sampling.stop):
        check_chars(f"sampling.stop[{index}]", stop, limits.max_stop_chars, "max_stop_chars")
    check_count("sampling.stop_token_ids", len(sampling.stop_token_ids), limits.max_stop_token_ids,
                "max_stop_token_ids", "ids")
    check_count("sampling.logit_bias", len(sampling.logit_bias), limits.max_logit_bias, "max_logit_bias")
    check_count("sampling.allowed_token_ids", len(sampling.allowed_token_ids), limits.max_allowed_token_ids,
                "max_allowed_token_ids", "ids")
    check_count("sampling.bad_words", len(sampling.bad_words), limits.max_bad_words, "max_bad_words", "words")
    for index, word in enumerate(sampling.bad_words):
        check_chars(f"sampling.bad_words[{index}]", word, limits.max_bad_word_chars, "max_bad_word_chars")
    kind = sampling.WhichOneof("constraint")
    if kind in ("json_schema", "regex", "grammar"):
        check_chars(f"sampling.{kind}", getattr(sampling, kind), limits.max_constraint_chars, "max_constraint_chars")
    elif kind == "choice":
        chars = sum(len(choice) for choice in sampling.choice.choices)
        if chars > limits.max_constraint_chars:
            raise InvalidArgument(f"sampling.choice has {chars} characters; the limit is {limits.max_constraint_chars} "
                                  f"({flag('max_constraint_chars')})", reason=OVER_LIMIT, field="sampling.choice")
    if sampling.n > limits.max_n:
        raise InvalidArgument(f"sampling.n is {sampling.n}; the limit is {limits.max_n} ({flag('max_n')})",
                              field="sampling.n")
    if sampling.top_logprobs and not sampling.logprobs:  # as OpenAI's (and the HTTP API's): never implied
        raise InvalidArgument(f"sampling.top_logprobs is {sampling.top_logprobs}, which needs sampling.logprobs true",
                              field="sampling.top_logprobs")
    if sampling.top_logprobs > limits.max_logprobs:
        raise InvalidArgument(f"sampling.top_logprobs is {sampling.top_logprobs}; the limit is "
                              f"{limits.max_logprobs} ({flag('max_logprobs')})", field="sampling.top_logprobs")
    if sampling.HasField("prompt_logprobs") and sampling.prompt_logprobs > limits.max_logprobs:
        raise InvalidArgument(f"sampling.prompt_logprobs is {sampling.prompt_logprobs}; the limit is "
                              f"{limits.max_logprobs} ({flag('max_logprobs')})", field="sampling.prompt_logprobs")
    if sampling.max_tokens < 0:  # before any image is encoded for a request that cannot run
        raise InvalidArgument(f"sampling.max_tokens must be >= 1 (or 0, unset: the rest of the context), "
                              f"got {sampling.max_tokens}", field="sampling.max_tokens")
    if max_model_len is not None and sampling.max_tokens >= max_model_len:
        raise InvalidArgument(f"sampling.max_tokens is {sampling.max_tokens}; the model's context is {max_model_len} "
                              "tokens, and the prompt needs at least one", field="sampling.max_tokens")


def _check_context(request, parts: list, max_model_len: int) -> None:
    """What fits the context without tokenizing: token ids and encoded images' grids, plus max_tokens
    (unset: one generated token at least)."""
    max_tokens = max(request.sampling.max_tokens, 1)
    wanted = f"max_tokens {max_tokens}" if request.sampling.max_tokens else "room for one generated token"
    num_ids = len(request.prompt_token_ids)
    if num_ids + max_tokens > max_model_len:
        raise InvalidArgument(f"prompt_token_ids has {num_ids} ids and {wanted}; the model's context is {max_model_len}",
                              field="prompt_token_ids")
    image_tokens = 0
    for part in parts:
        if part.WhichOneof("part") == "encoded_image":
            grid = part.encoded_image.grid_thw
            tokens = 1
            for side in grid[:3]:
                tokens *= max(side, 0)
            image_tokens += tokens
    if image_tokens + max_tokens > max_model_len:
        wanted = f"max_tokens is {max_tokens}" if request.sampling.max_tokens else "need room for one generated token"
        raise InvalidArgument(f"images expand to {image_tokens} tokens and {wanted}; "
                              f"the model's context is {max_model_len}")


def message_chars(message) -> int:
    """The characters a `tessera.v1.ChatMessage` puts into the prompt's text: its text parts, the
    id of the call it answers and its tool calls' names, ids and arguments (the template renders them)."""
    chars = sum(len(part.text) for part in message.content if part.WhichOneof("part") == "text")
    chars += len(message.tool_call_id)
    return chars + sum(len(call.id) + len(call.name) + len(call.arguments) for call in message.tool_calls)


def check_decoder_tokenize(field: str, texts, messages, limits: GenerateLimits, max_model_len: int | None) -> None:
    """Caps of a tokenize by the decoder's tokenizer: `texts` (the strings of `field`) and chat
    `messages` (`tessera.v1.ChatMessage`s) under Generate's message, part, role and prompt-text
    caps. `max_model_len`: as for `check_generate`. Raises InvalidArgument for the first cap passed."""
    check_count("messages", len(messages), limits.max_messages, "max_messages", "messages")
    num_parts = sum(len(message.content) for message in messages)
    check_count("messages", num_parts, limits.max_content_parts, "max_content_parts", "content parts", one_field=False)
    chars = sum(len(text) for text in texts)
    for index, message in enumerate(messages):
        check_chars(f"messages[{index}].role", message.role, limits.max_name_chars, "max_name_chars")
        chars += message_chars(message)
    cap = limits.prompt_chars(max_model_len)
    if cap is not None and chars > cap:
        raise InvalidArgument(f"{field} has {chars} characters of text; the limit is {cap} "
                              f"({flag('max_prompt_chars')}; default {CHARS_PER_CONTEXT_TOKEN} per context token)")


def check_detokenize(request, limits: GenerateLimits, max_model_len: int | None) -> None:
    """Caps of a `tessera.v1.DetokenizeRequest`: its model name, and at most a context's worth of
    token ids (no sequence of the model is longer; unchecked while `max_model_len` is None).
    Raises InvalidArgument."""
    check_chars("model", request.model, limits.max_name_chars, "max_name_chars")
    num_ids = len(request.token_ids)
    if max_model_len is not None and num_ids > max_model_len:
        raise InvalidArgument(f"token_ids has {num_ids} ids; the limit is the model's context, {max_model_len} tokens",
                              field="token_ids")


@dataclass(frozen=True)
class PoolingLimits:
    """Caps on one Embed, Rerank or Tokenize request (gateway and pooling).

    Attributes:
        max_name_chars: model, prompt_name and method.
        max_batch_size: inputs (text or token ids) per Embed or Tokenize, documents per Rerank.
        max_request_chars: characters of text over every input (or the query and every document).
        max_request_token_ids: token ids over every input_ids list of one Embed.

    Raises:
        ValueError: a cap below 1.
    """

    max_name_chars: int = _cap(256, "characters of a request's model, prompt_name and method")
    max_batch_size: int = _cap(64, "inputs per Embed or Tokenize, documents per Rerank")
    max_request_chars: int = _cap(2_000_000, "characters of text per request, checked before tokenizing")
    max_request_token_ids: int = _cap(262_144, "token ids over one Embed request's input_ids")

    def __post_init__(self) -> None:
        check_positive(self, ("max_name_chars", "max_batch_size", "max_request_chars", "max_request_token_ids"))


def check_embed(request, limits: PoolingLimits) -> None:
    """Caps of a `tessera.v1.EmbedRequest` (one EmbedStream message too). Raises InvalidArgument."""
    _check_names(request, ("model", "prompt_name"), limits)
    check_count("inputs", len(request.inputs), limits.max_batch_size, "max_batch_size", "inputs")
    check_count("input_ids", len(request.input_ids), limits.max_batch_size, "max_batch_size", "inputs")
    _check_texts("inputs", request.inputs, 0, limits)
    num_ids = sum(len(entry.ids) for entry in request.input_ids)
    check_count("input_ids", num_ids, limits.max_request_token_ids, "max_request_token_ids", "token ids")


def check_rerank(request, limits: PoolingLimits) -> None:
    """Caps of a `tessera.v1.RerankRequest`. Raises InvalidArgument."""
    _check_names(request, ("model", "method"), limits)
    check_count("documents", len(request.documents), limits.max_batch_size, "max_batch_size", "documents")
    _check_texts("query and documents", request.documents, len(request.query), limits)


def check_tokenize(request, limits: PoolingLimits) -> None:
    """Caps of a `tessera.v1.TokenizeRequest`. Raises InvalidArgument."""
    _check_names(request, ("model", "prompt_name"), limits)
    check_count("inputs", len(request.inputs), limits.max_batch_size, "max_batch_size", "inputs")
    _check_texts("inputs", request.inputs, 0, limits)


def _check_names(request, names: tuple[str, ...], limits: PoolingLimits) -> None:
    for name in names:
        check_chars(name, getattr(request, name), limits.max_name_chars, "max_name_chars")


def _check_texts(field: str, texts, extra_chars: int, limits: PoolingLimits) -> None:
    chars = extra_chars + sum(len(text) for text in texts)
    if chars > limits.max_request_chars:
        raise InvalidArgument(f"{field} hold {chars} characters of text; the limit is {limits.max_request_chars} "
                              f"({flag('max_request_chars')})")
