"""`PoolingConfig` / `read_st_config`: defaults come from the model directory; bad values are refused."""

from __future__ import annotations

import json
import shutil

import pytest

from services.pooling.__main__ import parse_args
from services.pooling.config import PoolingConfig
from services.pooling.st_config import read_st_config


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _model_dir(tmp_path, max_positions=64, tokenizer_max=512, name="tiny-encoder"):
    """A model directory with only what the config reads: config.json (+ tokenizer_config.json)."""
    d = tmp_path / name
    _write(d / "config.json", {"model_type": "bert", "hidden_size": 8, "max_position_embeddings": max_positions})
    if tokenizer_max is not None:
        _write(d / "tokenizer_config.json", {"model_max_length": tokenizer_max})
    return d


def _st_files(d, pooling, normalize):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    _write(d / "modules.json", modules)
    _write(d / "1_Pooling" / "config.json", {"word_embedding_dimension": 8, **pooling})


def test_prepared_minilm_defaults(minilm_dir):
    config = PoolingConfig(model_dir=minilm_dir)
    assert config.pooling_mode == "mean"
    assert config.normalize is True  # modules.json has a Normalize module
    assert config.max_input_length == 256  # sentence_bert_config.json, not the tokenizer's 512
    assert config.model_name == "all-minilm-l6-v2"
    assert config.max_batch_size == 64


@pytest.mark.parametrize("pooling, mode", [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, "last"),
    ({"pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode": "lasttoken"}, "last"),
])
def test_pooling_mode_from_sentence_transformers_files(tmp_path, pooling, mode):
    d = _model_dir(tmp_path)
    _st_files(d, pooling, normalize=False)
    st = read_st_config(d)
    assert (st.pooling_mode, st.normalize) == (mode, False)
    config = PoolingConfig(model_dir=d)
    assert (config.pooling_mode, config.normalize) == (mode, False)


def test_normalize_module_and_sbert_config(tmp_path):
    d = _model_dir(tmp_path)
    _st_files(d, {"pooling_mode_cls_token": True}, normalize=True)
    _write(d / "sentence_bert_config.json", {"max_seq_length": 40, "do_lower_case": True})
    config = PoolingConfig(model_dir=d)
    assert (config.pooling_mode, config.normalize, config.max_input_length, config.do_lower_case) == ("cls", True, 40, True)


@pytest.mark.parametrize("pooling", [{"pooling_mode_max_tokens": True},
                                     {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
                                     {"pooling_mode_mean_tokens": False}])
def test_unsupported_or_ambiguous_pooling_is_refused(tmp_path, pooling):
    d = _model_dir(tmp_path)
    _st_files(d, pooling, normalize=False)
    with pytest.raises(ValueError, match="pooling mode"):
        PoolingConfig(model_dir=d)


def test_overrides_win_over_the_model(minilm_dir):
    config = PoolingConfig(model_dir=minilm_dir, pooling_mode="cls", normalize=False, max_input_length=512)
    assert (config.pooling_mode, config.normalize, config.max_input_length) == ("cls", False, 512)


@pytest.mark.parametrize("tokenizer_max, expected", [(512, 64), (32, 32), (None, 64), (10**30, 64)])
def test_plain_transformers_dir_limit_is_tokenizer_capped_by_positions(tmp_path, tokenizer_max, expected):
    d = _model_dir(tmp_path, max_positions=64, tokenizer_max=tokenizer_max)
    config = PoolingConfig(model_dir=d)
    assert config.max_input_length == expected
    # as sentence-transformers wraps a plain model: mean pooling, no Normalize module
    assert (config.pooling_mode, config.normalize, config.model_name) == ("mean", False, "tiny-encoder")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch_size": 0}, "max_batch_size must be >= 1, got 0"),
    ({"max_input_length": 0}, "max_input_length must be >= 1, got 0"),
    ({"max_input_length": 513}, "513 exceeds the model's max_position_embeddings 512"),
    ({"pooling_mode": "max"}, "pooling_mode must be one of"),
    ({"address": "50054"}, "host:port"),
])
def test_invalid_values_are_refused(minilm_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolingConfig(model_dir=minilm_dir, **kwargs)


def test_missing_model_dir_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        PoolingConfig(model_dir=tmp_path / "absent")


def test_cli_flags_map_onto_the_config(minilm_dir, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(minilm_dir, d, ignore=shutil.ignore_patterns("*.safetensors"))
    config = parse_args(["--address", "0.0.0.0:6000", "--model-dir", str(d), "--max-batch-size", "8",
                         "--max-input-length", "100", "--pooling-mode", "last", "--no-normalize"])
    assert (config.address, config.model_dir, config.max_batch_size, config.max_input_length,
            config.pooling_mode, config.normalize, config.model_name) == \
        ("0.0.0.0:6000", d, 8, 100, "last", False, "copy")
    assert parse_args(["--model-dir", str(d)]).normalize is True
    assert parse_args(["--model-dir", str(d), "--normalize", "--pooling-mode", "mean"]).normalize is True
    with pytest.raises(SystemExit):
        parse_args(["--model-dir", str(d), "--max-batch-size", "0"])
