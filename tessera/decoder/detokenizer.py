"""Incremental detokenization with stop strings.

Text deltas come from decoding a short window (`prefix_offset:read_offset` vs `prefix_offset:`,
the vLLM scheme) so spacing stays right and a multi-byte character split across tokens is held
back while the decode ends in U+FFFD. With stop strings, the last `len(longest stop) - 1`
characters are held back until they can no longer start a match; a matched stop string and
everything after it is never returned.
"""

from __future__ import annotations

PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""       # stable output text so far (truncated at a stop string)
        self.num_emitted = 0  # characters of `text` already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> bool:
        """Feed one generated token; returns True when a stop string matched."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        search_from = max(0, len(self.text) - self.holdback)
        self.text += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index >= 0:
                self.text = self.text[:index]
                self.stopped = True
        return self.stopped

    def delta(self, final: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix unless `final`."""
        end = len(self.text) if (final or self.stopped) else max(self.num_emitted, len(self.text) - self.holdback)
        out = self.text[self.num_emitted:end]
        self.num_emitted = end
        return out
