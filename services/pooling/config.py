"""`PoolingConfig`: what the pooling service serves and the limits it enforces, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.common.paths import default_embedding_dir
from services.common.server import DEFAULT_PORTS
from services.pooling.st_config import POOLING_MODES, read_st_config

# Tokenizers without a real limit report a huge sentinel (transformers' VERY_LARGE_INTEGER).
_NO_TOKENIZER_LIMIT = 10**9


@dataclass
class PoolingConfig:
    """Pooling service settings; `None` fields are resolved from the model directory.

    Attributes:
        address: host:port the service binds.
        model_dir: a local transformers / sentence-transformers directory (never a hub id).
        max_batch_size: most inputs (or rerank documents) in one request; each request is one
            padded forward of at most this many rows (plus the query, for rerank).
        max_input_length: most tokens per input, special tokens included. Default: the
            sentence-transformers `max_seq_length`, else the tokenizer's `model_max_length`
            capped by the model's `max_position_embeddings`. Longer inputs are refused, never truncated.
        pooling_mode: "mean", "cls" or "last"; default from `1_Pooling/config.json`.
        normalize: unit-normalize embeddings by default; default True when `modules.json` has a
            Normalize module. A request may still override it.
        model_name: the name requests may address; default the directory name.
        device: torch device for the encoder ("cpu", "cuda", "cuda:1").
        do_lower_case: lower-case texts before tokenizing (from `sentence_bert_config.json`).

    Raises:
        ValueError: an address without a port, a missing model directory, a limit below 1, a max_input_length past the
            model's position embeddings, or an unknown pooling mode.
    """

    address: str = f"127.0.0.1:{DEFAULT_PORTS['pooling']}"
    model_dir: Path = field(default_factory=default_embedding_dir)
    max_batch_size: int = 64
    max_input_length: int | None = None
    pooling_mode: str | None = None
    normalize: bool | None = None
    model_name: str | None = None
    device: str = "cpu"
    do_lower_case: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if ":" not in self.address:
            raise ValueError(f"address must be host:port, got {self.address!r}")
        self.model_dir = Path(self.model_dir).expanduser()
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"model_dir {str(self.model_dir)!r} has no config.json; expected a local transformers model directory")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        st = read_st_config(self.model_dir)
        self.do_lower_case = st.do_lower_case
        if self.pooling_mode is None:
            self.pooling_mode = st.pooling_mode
        if self.pooling_mode not in POOLING_MODES:
            raise ValueError(f"pooling_mode must be one of {POOLING_MODES}, got {self.pooling_mode!r}")
        if self.normalize is None:
            self.normalize = st.normalize
        if self.model_name is None:
            self.model_name = self.model_dir.name
        if not self.model_name:
            raise ValueError("model_name must be non-empty")
        self.max_input_length = self._resolve_max_input_length(st.max_seq_length)

    def _resolve_max_input_length(self, st_max_seq_length: int | None) -> int:
        max_positions = _model_max_positions(self.model_dir)
        if self.max_input_length is not None:
            if self.max_input_length < 1:
                raise ValueError(f"max_input_length must be >= 1, got {self.max_input_length}")
            if max_positions is not None and self.max_input_length > max_positions:
                raise ValueError(f"max_input_length {self.max_input_length} exceeds the model's "
                                 f"max_position_embeddings {max_positions}")
            return self.max_input_length
        if st_max_seq_length is not None:
            return st_max_seq_length
        limits = [n for n in (_tokenizer_max_length(self.model_dir), max_positions) if n is not None]
        if not limits:
            raise ValueError(f"{self.model_dir}: neither the tokenizer nor the model states a maximum length; "
                             "set max_input_length")
        return min(limits)


def _model_max_positions(model_dir: Path) -> int | None:
    config = json.loads((model_dir / "config.json").read_text())
    value = config.get("max_position_embeddings")
    return int(value) if value is not None else None


def _tokenizer_max_length(model_dir: Path) -> int | None:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("model_max_length")
    if value is None or value >= _NO_TOKENIZER_LIMIT:
        return None
    return int(value)
