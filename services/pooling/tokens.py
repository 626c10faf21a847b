"""`ModelTokenizer`: texts, pairs, prompts and raw ids become `Sequence`s that fit the model.

Inputs past `max_input_length` are refused with their token count, unless the request asks for
truncation; then the tokenizer itself truncates (special tokens kept), keeping the first
(direction "right") or last ("left") tokens, as TEI's `truncation_direction`. Pairs use the
tokenizer's own pair convention (`tokenizer(query, document)`: [CLS] q [SEP] d [SEP] with token
type ids 0/1 for BERT), never an invented separator.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from services.common.errors import InvalidArgument

TRUNCATION_DIRECTIONS = ("right", "left")
TRUNCATE_HINT = "set truncate to cut it"
RERANK_TRUNCATE_HINT = "set truncate to cut it"  # cross-encoder pairs, bi-encoder texts
JUDGE_TRUNCATE_HINT = "an llm-judge prompt is never cut, its template's end must stay; shorten the query or the document"


@dataclass(frozen=True)
class Sequence:
    """One model input row, unpadded.

    Attributes:
        input_ids: token ids, special tokens included.
        token_type_ids: segment ids (0 = first text, 1 = second) for models that take them, else None.
    """

    input_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Token:
    """One token of a Tokenize answer; `start`/`stop` are character offsets (0, 0 for added special tokens)."""

    id: int
    text: str
    special: bool
    start: int
    stop: int


class ModelTokenizer:
    """A model's `AutoTokenizer` (local files only) with tessera's length rules.

    Args:
        model_dir: local transformers directory.
        max_input_length: most tokens per sequence, special tokens included.
        do_lower_case: lower-case texts first (sentence-transformers' Transformer option).
    """

    def __init__(self, model_dir: Path, max_input_length: int, do_lower_case: bool = False):
        self.max_input_length = max_input_length
        self.do_lower_case = do_lower_case
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.tokenizer.truncation_side = "right"
        # A second instance, so concurrent threads never flip a shared truncation_side.
        self._left = copy.deepcopy(self.tokenizer)
        self._left.truncation_side = "left"
        self._with_types = "token_type_ids" in self.tokenizer.model_input_names

    @property
    def pad_token_id(self) -> int:
        """The id padding slots hold (masked out; 0 when the tokenizer has no pad token)."""
        pad = self.tokenizer.pad_token_id
        return 0 if pad is None else int(pad)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode_texts(self, texts: list[str], *, truncate: bool = False, direction: str = "right",
                     add_special_tokens: bool = True, labels: list[str] | None = None,
                     hint: str = TRUNCATE_HINT) -> list[Sequence]:
        """Tokenize single texts.

        Args:
            labels: how error messages name each text (default "input 3").
            hint: what the too-long message advises (callers that cannot truncate say so).

        Raises:
            InvalidArgument: an input past max_input_length without `truncate` (the message quotes its
                label, its token count and the limit), or an unknown direction.
        """
        texts = [t.lower() for t in texts] if self.do_lower_case else list(texts)
        return self._encode(texts, None, truncate, direction, add_special_tokens, labels, hint)

    def encode_pairs(self, query: str, documents: list[str], labels: list[str] | None = None, *,
                     truncate: bool = False, direction: str = "right") -> list[Sequence]:
        """Tokenize (query, document) pairs with the tokenizer's pair convention; with `truncate`, a
        pair past max_input_length is cut to it a token at a time from the longer of the two
        ("longest_first": sentence-transformers' CrossEncoder and TEI), at the `direction` end.

        Raises:
            InvalidArgument: a pair past max_input_length without `truncate` (its label, token count
                and the limit), or an unknown direction.
        """
        if self.do_lower_case:
            query, documents = query.lower(), [d.lower() for d in documents]
        return self._encode([query] * len(documents), documents, truncate, direction, True, labels,
                            RERANK_TRUNCATE_HINT)

    def encode_ids(self, id_lists: list[list[int]], *, truncate: bool = False, direction: str = "right") -> list[Sequence]:
        """Check and (when asked) cut pre-tokenized inputs; special tokens are the client's to include.

        Raises:
            InvalidArgument: an empty list, an id outside [0, vocab size), an input past
                max_input_length without `truncate`.
        """
        _check_direction(direction)
        sequences = []
        for index, ids in enumerate(id_lists):
            if not ids:
                raise InvalidArgument(f"input_ids[{index}] is empty; every input must hold tokens")
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise InvalidArgument(f"input_ids[{index}] holds id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
            if len(ids) > self.max_input_length:
                if not truncate:
                    raise self._too_long(f"input {index}", len(ids), TRUNCATE_HINT)
                ids = ids[: self.max_input_length] if direction == "right" else ids[-self.max_input_length:]
            types = (0,) * len(ids) if self._with_types else None
            sequences.append(Sequence(tuple(ids), types))
        return sequences

    def tokens(self, texts: list[str], add_special_tokens: bool = True) -> list[list[Token]]:
        """Tokens with their text, special flag and character offsets, as TEI's Tokenize answers."""
        texts = [t.lower() for t in texts] if self.do_lower_case else list(texts)
        encoded = self.tokenizer(texts, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        special_ids = set(self.tokenizer.all_special_ids)
        out = []
        for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True):
            pieces = self.tokenizer.convert_ids_to_tokens(ids)
            out.append([Token(id=i, text=p, special=i in special_ids, start=s, stop=e)
                        for i, p, (s, e) in zip(ids, pieces, offsets, strict=True)])
        return out

    def _encode(self, first: list[str], second: list[str] | None, truncate: bool, direction: str,
                add_special_tokens: bool, labels: list[str] | None, hint: str) -> list[Sequence]:
        _check_direction(direction)
        args = (first,) if second is None else (first, second)
        encoded = self.tokenizer(*args, truncation=False, add_special_tokens=add_special_tokens)
        rows = list(encoded["input_ids"])
        types = list(encoded["token_type_ids"]) if self._with_types and "token_type_ids" in encoded else None
        long_rows = [i for i, ids in enumerate(rows) if len(ids) > self.max_input_length]
        if long_rows and not truncate:
            index = long_rows[0]
            raise self._too_long(labels[index] if labels else f"input {index}", len(rows[index]), hint)
        if long_rows:
            tokenizer = self.tokenizer if direction == "right" else self._left
            cut_args = [[first[i] for i in long_rows]] + ([[second[i] for i in long_rows]] if second else [])
            cut = tokenizer(*cut_args, truncation="longest_first", max_length=self.max_input_length,
                            add_special_tokens=add_special_tokens)
            for j, i in enumerate(long_rows):
                rows[i] = cut["input_ids"][j]
                if types is not None:
                    types[i] = cut["token_type_ids"][j]
        return [Sequence(tuple(ids), tuple(types[i]) if types is not None else None) for i, ids in enumerate(rows)]

    def _too_long(self, label: str, num_tokens: int, hint: str) -> InvalidArgument:
        return InvalidArgument(f"{label} has {num_tokens} tokens; the maximum input length is {self.max_input_length} "
                               f"({hint})")


def _check_direction(direction: str) -> None:
    if direction not in TRUNCATION_DIRECTIONS:
        raise InvalidArgument(f"truncation direction must be one of {TRUNCATION_DIRECTIONS}, got {direction!r}")
