"""Logprobs as users read them, from the decoder's TokenLogprob entries (each with the token's
text and exact bytes): OpenAI's chat logprobs, OpenAI's legacy completions logprobs (with
`text_offset`), and vLLM's `prompt_logprobs`.

A token is shown by its text, or as `token_id:<id>` (vLLM's return_tokens_as_token_ids form) when
asked for, or when the decoder sent no text for it.
"""

from __future__ import annotations

import codecs

from services.gateway.http.chat.protocol import (
    ChoiceLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)
from tessera.v1 import decoder_pb2

LOGPROB_FLOOR = -9999.0  # OpenAI's (and vLLM's) stand-in for -inf, which JSON cannot carry


def token_id_str(token_id: int) -> str:
    return f"token_id:{token_id}"


def _text(entry, as_ids: bool) -> str:
    if as_ids or not (entry.token or entry.token_bytes):
        return token_id_str(entry.token_id)
    return entry.token


def _bytes(entry) -> bytes:
    return entry.token_bytes or entry.token.encode()


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(entries, as_ids: bool) -> ChoiceLogprobs:
    """OpenAI's chat logprobs: per token its text, logprob, bytes and `top_logprobs` alternatives."""
    return ChoiceLogprobs(content=[
        TokenLogprob(token=_text(e, as_ids), logprob=_logprob(e.logprob), bytes=list(_bytes(e)),
                               top_logprobs=[TopLogprob(token=_text(t, as_ids), logprob=_logprob(t.logprob),
                                                                  bytes=list(_bytes(t))) for t in e.top])
        for e in entries])


class LegacyLogprobs:
    """One choice's legacy logprobs, built as its tokens arrive (with echo, the prompt's first).

    `text_offset` is each token's character offset in the returned text: the characters its
    preceding tokens' bytes decode to (UTF-8; a character split across tokens counts at the token
    that completes it). `top_logprobs` per token: the chosen token first, then its alternatives
    (vLLM's order; `logprobs: 0` leaves the chosen one only).
    """

    def __init__(self, as_ids: bool):
        self.as_ids = as_ids
        self.answer = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def _append(self, text: str, data: bytes, logprob: float | None, top: dict[str, float] | None) -> None:
        self.answer.text_offset.append(self._chars)
        self._chars += len(self._decoder.decode(data))
        self.answer.tokens.append(text)
        self.answer.token_logprobs.append(logprob)
        self.answer.top_logprobs.append(top)

    def add(self, entry) -> None:
        """A token with its logprob and alternatives (generated, or a prompt token past the first)."""
        top = {_text(entry, self.as_ids): _logprob(entry.logprob)}
        for alternative in entry.top:
            top.setdefault(_text(alternative, self.as_ids), _logprob(alternative.logprob))
        self._append(_text(entry, self.as_ids), _bytes(entry), _logprob(entry.logprob), top)

    def add_prompt(self, message: decoder_pb2.GenerateResponse) -> None:
        """The prompt's tokens, from a choice's first message (return_prompt and prompt_logprobs):
        the first has no logprob (no context), the others are its `prompt_logprobs`."""
        if not message.prompt_token_ids:
            return
        first_id = message.prompt_token_ids[0]
        rest = b"".join(_bytes(e) for e in message.prompt_logprobs)
        whole = message.prompt_text.encode()
        if self.as_ids or not whole.endswith(rest) or len(whole) == len(rest):
            text, data = token_id_str(first_id), b""  # its text is not known apart from the others'
        else:
            data = whole[:len(whole) - len(rest)]
            text = data.decode("utf-8", errors="replace")
        self._append(text, data, None, None)
        for entry in message.prompt_logprobs:
            self.add(entry)

    def since(self, start: int) -> CompletionLogprobs:
        """The entries from the `start`-th (a stream event's share)."""
        a = self.answer
        return CompletionLogprobs(text_offset=a.text_offset[start:], token_logprobs=a.token_logprobs[start:],
                                            tokens=a.tokens[start:], top_logprobs=a.top_logprobs[start:])

    def __len__(self) -> int:
        return len(self.answer.tokens)


def prompt_logprobs(message: decoder_pb2.GenerateResponse) -> PromptLogprobs:
    """vLLM's prompt_logprobs from a choice's first message: null for the first prompt token, then
    per token {id: {logprob, rank, decoded_token}}, the prompt's token first (rank: its place in
    the whole distribution, the decoder's), then the alternatives (rank = place among them, 1 =
    most likely)."""
    out: PromptLogprobs = [None]
    for entry in message.prompt_logprobs:
        ranks = {t.token_id: i + 1 for i, t in enumerate(entry.top)}
        position = {str(entry.token_id): PromptLogprob(logprob=_logprob(entry.logprob),
                                                                 rank=entry.rank or ranks.get(entry.token_id),
                                                                 decoded_token=_text(entry, False))}
        for t in entry.top:
            position.setdefault(str(t.token_id), PromptLogprob(
                logprob=_logprob(t.logprob), rank=ranks[t.token_id], decoded_token=_text(t, False)))
        out.append(position)
    return out
