"""Incremental detokenization with stop strings.

Text deltas come from decoding a short window (`prefix_offset:read_offset` vs `prefix_offset:`,
the vLLM scheme) so spacing stays right and a multi-byte character split across tokens is held
back while the decode ends in U+FFFD. With stop strings, the last `len(longest stop) - 1`
characters are held back until they can no longer start a match; a matched stop string and
everything after it is never returned, unless `include_stop_str_in_output` keeps the stop string
(then nothing need be held back: what was returned is a prefix of the final text either way).
Stop strings are looked for from the token after the first `min_tokens` (vLLM's detokenizer), in
the text that token added (and the held-back tail before it).
"""

from __future__ import annotations

from services.decoder.types import SamplingParams

PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """The text of one choice, token by token, as `params` asks for it: stop strings, their
    inclusion, min_tokens, and `skip_special_tokens` / `spaces_between_special_tokens` passed to
    the tokenizer's decode (fast tokenizers ignore the latter, as vLLM documents)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.decode_options = {"skip_special_tokens": params.skip_special_tokens,
                               "spaces_between_special_tokens": params.spaces_between_special_tokens}
        longest = max((len(s) for s in self.stop), default=1)
        self.holdback = 0 if self.include_stop else longest - 1
        self.search_back = longest - 1  # a stop string may begin this far before the new text
        self.num_tokens = 0   # generated tokens fed so far
        self.text = ""        # stable output text so far (truncated at a stop string)
        self.num_emitted = 0  # characters of `text` already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.decode_options)

    def add(self, token_id: int) -> bool:
        """Feed one generated token; returns True when a stop string matched."""
        self.ids.append(token_id)
        self.num_tokens += 1
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        search_from = max(0, len(self.text) - self.search_back)
        self.text += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop and self.num_tokens > self.min_tokens:
            self._cut_at_stop(search_from)
        return self.stopped

    def _cut_at_stop(self, search_from: int) -> None:
        """End the text at the earliest stop string found from `search_from` (before it, or after
        it with include_stop_str_in_output)."""
        found = [(index, len(stop)) for stop in self.stop if (index := self.text.find(stop, search_from)) >= 0]
        if found:
            index, length = min(found)
            self.text = self.text[:index + length if self.include_stop else index]
            self.stopped = True

    def delta(self, final: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix unless `final`."""
        end = len(self.text) if (final or self.stopped) else max(self.num_emitted, len(self.text) - self.holdback)
        out = self.text[self.num_emitted:end]
        self.num_emitted = end
        return out
