"""Each token's text and exact bytes, as logprobs report them.

Text: `tokenizer.decode([id])` with special tokens kept, as vLLM's `convert_ids_list_to_tokens`
gives logprob tokens; a token holding part of a multi-byte character decodes to U+FFFD. Bytes
(OpenAI's `bytes`): for a byte-level BPE tokenizer (GPT-2's scheme: SmolLM2, Llama 3, Qwen), the
bytes the vocabulary entry stands for, read back through GPT-2's byte-to-unicode table, so the
tokens of a character split across tokens concatenate to its UTF-8; for a byte-fallback piece
(`<0xE2>` of SentencePiece tokenizers: Llama 2, Mistral) its one byte; for an added token (special
or not) and any other token, the text's UTF-8.
"""

from __future__ import annotations

import json
import re

from transformers.convert_slow_tokenizer import bytes_to_unicode

from services.decoder.types import TokenText

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class TokenTexts:
    """Text and bytes of token ids for one tokenizer, each id decoded once (the cache grows to at
    most the vocabulary). Not thread-safe: the engine thread owns it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoders = _decoder_types(tokenizer)
        self._byte_decoder = ({char: byte for byte, char in bytes_to_unicode().items()} if "ByteLevel" in decoders
                              else None)
        self._byte_fallback = "ByteFallback" in decoders
        self._added_ids = set(getattr(tokenizer, "added_tokens_decoder", {}))
        self._cache: dict[int, TokenText] = {}

    def __call__(self, token_id: int) -> TokenText:
        """The text and bytes of `token_id` (an id of the vocabulary)."""
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._compute(token_id)
        return found

    def of(self, token_ids) -> dict[int, TokenText]:
        """{id: its text and bytes} for each distinct id of `token_ids`."""
        return {token_id: self(token_id) for token_id in token_ids}

    def _compute(self, token_id: int) -> TokenText:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = None if token_id in self._added_ids else self.tokenizer.convert_ids_to_tokens(token_id)
        if piece and self._byte_decoder is not None and all(char in self._byte_decoder for char in piece):
            return TokenText(text, bytes(self._byte_decoder[char] for char in piece))
        if piece and self._byte_fallback and _BYTE_PIECE.fullmatch(piece):
            return TokenText(text, bytes([int(piece[3:5], 16)]))
        return TokenText(text, text.encode())


def _decoder_types(tokenizer) -> set[str]:
    """The types of the (fast) tokenizer's decoder and, for a sequence, of its parts."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    state = json.loads(decoder.__getstate__())
    return {state["type"], *(part["type"] for part in state.get("decoders", ()))}
