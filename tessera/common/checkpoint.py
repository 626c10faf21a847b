"""A Hugging Face checkpoint's config.json, read once into a typed object its loaders receive."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CheckpointConfig:
    """The fields of config.json tessera reads, for the language model of the checkpoint.

    A vision-language checkpoint nests its language model's config in `text_config`; the typed
    fields come from there when present (the top level otherwise). `raw` keeps the whole file for
    family-specific keys (vision_config, rope_scaling, judge templates).

    Attributes:
        model_dir: the checkpoint directory.
        raw: config.json as parsed.
        model_type, architectures: as in the file ("" and () when absent).
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        max_position_embeddings: None when absent.
        num_key_value_heads: the config's, else num_attention_heads (no grouped-query attention).
        head_dim: the config's `head_dim`, else hidden_size // num_attention_heads (the
            transformers Llama/Qwen2 convention); None when neither is known.
    """

    model_dir: Path
    raw: Mapping[str, Any]
    model_type: str
    architectures: tuple[str, ...]
    hidden_size: int | None
    intermediate_size: int | None
    num_hidden_layers: int | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    max_position_embeddings: int | None

    @classmethod
    def read(cls, model_dir: str | Path) -> CheckpointConfig:
        """Raises ValueError: no readable config.json in `model_dir` (the message names the path)."""
        model_dir = Path(model_dir).expanduser()
        path = model_dir / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"model_dir {str(model_dir)!r} has no readable config.json: {error}") from error
        text = raw.get("text_config") or raw
        hidden = _int(text.get("hidden_size"))
        heads = _int(text.get("num_attention_heads"))
        head_dim = _int(text.get("head_dim")) or (hidden // heads if hidden and heads else None)
        return cls(model_dir=model_dir, raw=raw, model_type=raw.get("model_type", ""),
                   architectures=tuple(raw.get("architectures") or ()), hidden_size=hidden,
                   intermediate_size=_int(text.get("intermediate_size")),
                   num_hidden_layers=_int(text.get("num_hidden_layers")), num_attention_heads=heads,
                   num_key_value_heads=_int(text.get("num_key_value_heads")) or heads, head_dim=head_dim,
                   max_position_embeddings=_int(text.get("max_position_embeddings")))

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level key of config.json."""
        return self.raw.get(key, default)


def _int(value: Any) -> int | None:
    return int(value) if value is not None else None
