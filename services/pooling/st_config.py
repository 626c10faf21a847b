"""Read a sentence-transformers model directory: pooling mode, normalization, max sequence length.

The files and their meaning follow sentence-transformers (`SentenceTransformer._load_sbert_model`):

- `modules.json`: the module pipeline. A `sentence_transformers.models.Normalize` entry means the
  trained embeddings are unit-normalized; its `Pooling` entry names the pooling folder.
- `<pooling folder>/config.json` (usually `1_Pooling/`): `pooling_mode_mean_tokens`,
  `pooling_mode_cls_token`, `pooling_mode_lasttoken`, ... (booleans; newer releases may also write
  a `pooling_mode` string).
- `sentence_bert_config.json`: `max_seq_length` and `do_lower_case` of the Transformer module.
- `config_sentence_transformers.json`: `prompts` (name -> prefix text, e.g. "query" -> "query: ")
  and `default_prompt_name`, as `SentenceTransformer.encode(prompt_name=...)` applies them.

A plain transformers directory (no `modules.json`) reads as sentence-transformers would wrap it:
mean pooling, no Normalize module, no sequence limit of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POOLING_MODES = ("mean", "cls", "last")

_NORMALIZE_TYPE = "sentence_transformers.models.Normalize"
_POOLING_TYPE = "sentence_transformers.models.Pooling"

# sentence-transformers' boolean keys -> our mode names; the others (max, weightedmean,
# mean_sqrt_len) have no implementation here and are refused rather than silently replaced.
_BOOLEAN_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_STRING_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last", "last": "last"}


@dataclass(frozen=True)
class SentenceTransformerConfig:
    """What a model directory says about pooling.

    Attributes:
        pooling_mode: "mean", "cls" or "last".
        normalize: True when `modules.json` has a Normalize module.
        max_seq_length: the Transformer module's limit in tokens, or None when the directory has none.
        do_lower_case: lower-case texts before tokenizing (sentence-transformers' Transformer module).
        pooling_declared: False when the directory has no pooling config (the mode is then a default).
        prompts: prompt name -> prefix prepended to the text.
        default_prompt_name: the prompt applied when a request names none, or None.
    """

    pooling_mode: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False
    pooling_declared: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None


def read_st_config(model_dir: Path) -> SentenceTransformerConfig:
    """Parse the sentence-transformers files of `model_dir` (missing files take the defaults above).

    Raises:
        ValueError: a pooling config selects no mode, several modes, or a mode tessera does not
            implement (max, mean_sqrt_len, weightedmean); a file is not valid JSON.
    """
    model_dir = Path(model_dir)
    modules = _read_json(model_dir / "modules.json") or []
    normalize = any(m.get("type") == _NORMALIZE_TYPE for m in modules)
    pooling_paths = [m.get("path", "") for m in modules if m.get("type") == _POOLING_TYPE]
    pooling_dir = model_dir / (pooling_paths[0] if pooling_paths else "1_Pooling")
    pooling = _read_json(pooling_dir / "config.json")
    mode = _pooling_mode(pooling, pooling_dir) if pooling is not None else "mean"
    sbert = _read_json(model_dir / "sentence_bert_config.json") or {}
    max_seq_length = sbert.get("max_seq_length")
    st = _read_json(model_dir / "config_sentence_transformers.json") or {}
    prompts = {str(k): str(v) for k, v in (st.get("prompts") or {}).items()}
    default_prompt_name = st.get("default_prompt_name")
    if default_prompt_name is not None and default_prompt_name not in prompts:
        raise ValueError(f"{model_dir}: default_prompt_name {default_prompt_name!r} is not one of its prompts {sorted(prompts)}")
    return SentenceTransformerConfig(
        pooling_mode=mode,
        normalize=normalize,
        max_seq_length=int(max_seq_length) if max_seq_length is not None else None,
        do_lower_case=bool(sbert.get("do_lower_case", False)),
        pooling_declared=pooling is not None,
        prompts=prompts,
        default_prompt_name=default_prompt_name,
    )


def _pooling_mode(pooling: dict[str, Any], pooling_dir: Path) -> str:
    if isinstance(pooling.get("pooling_mode"), str):
        name = pooling["pooling_mode"]
        if name not in _STRING_MODES:
            raise ValueError(f"{pooling_dir}: pooling_mode {name!r} is not supported; tessera implements {POOLING_MODES}")
        return _STRING_MODES[name]
    selected = [mode for key, mode in _BOOLEAN_KEYS.items() if pooling.get(key)]
    if len(selected) != 1:
        raise ValueError(f"{pooling_dir}: expected exactly one pooling mode, found {selected or 'none'}; "
                         f"tessera implements one of {POOLING_MODES}")
    if selected[0] not in POOLING_MODES:
        raise ValueError(f"{pooling_dir}: pooling mode {selected[0]!r} is not supported; tessera implements {POOLING_MODES}")
    return selected[0]


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
