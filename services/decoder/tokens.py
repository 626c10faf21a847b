"""Tokenize and detokenize with the served model's tokenizer, as vLLM's /tokenize and /detokenize.

Text is tokenized as is (add_special_tokens default true); chat messages are rendered with the
model's chat template as Generate renders them (`multimodal.render_chat`: generation prompt by
default, continue_final_message, template variables) and tokenized without adding special tokens
again, so the ids equal `tokenizer.apply_chat_template(messages, tokenize=True, ...)` with the same options.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from services.common.errors import InvalidArgument
from services.decoder.multimodal import ROLES, chat_text_joiner, check_chat_options, render_chat, template_message
from services.decoder.types import TextPart, TokenizeInput


def tokenize(tokenizer, request: TokenizeInput) -> list[int]:
    """Token ids of `request`'s text or rendered messages.

    Raises:
        InvalidArgument: neither or both of text and messages, a message with an image part or an
            unknown role, chat options on text, or the template refused them (`render_chat`).
    """
    if bool(request.text) == bool(request.messages):
        raise InvalidArgument("exactly one of text (prompt) or messages must be set; an empty prompt is not accepted")
    check_chat_options(bool(request.messages), request.chat)
    if request.text:
        specials = True if request.add_special_tokens is None else request.add_special_tokens
        return tokenizer(request.text, add_special_tokens=specials)["input_ids"]
    rendered, joiner = [], chat_text_joiner(tokenizer)
    for index, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise InvalidArgument(f"messages[{index}].role is {message.role!r}; expected one of {ROLES}")
        if not all(isinstance(part, TextPart) for part in message.content):
            raise InvalidArgument(f"messages[{index}] has an image part; tokenize counts text only")
        rendered.append(template_message(message, joiner.join(part.text for part in message.content)))
    text = render_chat(tokenizer, rendered, request.chat)
    return tokenizer(text, add_special_tokens=bool(request.add_special_tokens))["input_ids"]


# A chat template renders in milliseconds; one that does not finish a two-message conversation in
# this time would hold a worker thread per request for ever (a Python thread cannot be stopped).
TEMPLATE_CHECK_S = 10.0


def check_chat_template(tokenizer, timeout_s: float = TEMPLATE_CHECK_S) -> None:
    """Render the tokenizer's chat template once, at start, on a system + user conversation (and a
    user message alone), each in a daemon thread given `timeout_s`. A template that raises for them
    is left to refuse its requests (some refuse a system role); one that does not finish is refused.

    Raises:
        ValueError: the template did not render within `timeout_s` (the thread is left running: the
            decoder then exits).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return
    for messages in ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                     [{"role": "user", "content": "Hello"}]):
        worker = threading.Thread(target=_render_quietly, args=(tokenizer, messages), daemon=True,
                                  name="chat-template-check")
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise ValueError(f"the checkpoint's chat template did not render a {len(messages)}-message "
                             f"conversation within {timeout_s:g} s; every chat request would hang a worker")


def _render_quietly(tokenizer, messages: list[dict]) -> None:
    try:
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # a refusal is the template's answer to those messages; only a hang is checked
        pass


def detokenize(tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """The text of `token_ids` (`tokenizer.decode`).

    Raises:
        InvalidArgument: an id outside the tokenizer's vocabulary [0, len(tokenizer)).
    """
    vocab_size = len(tokenizer)
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(f"token_ids[{index}] is {token_id}, outside the vocabulary [0, {vocab_size})",
                                  field=f"token_ids[{index}]")
    return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def bad_words_token_ids(tokenizer, bad_words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences the sampler bans for `bad_words`, as vLLM's
    SamplingParams.update_from_tokenizer: each word, its leading spaces stripped, tokenized without
    special tokens; then with one leading space, kept where that gives a different first token and
    as many tokens (the word inside a text rather than at its start)."""
    sequences: list[tuple[int, ...]] = []
    for word in bad_words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if bare:  # a tokenizer that drops the whole word bans nothing for it
            sequences.append(bare)
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return tuple(sequences)
