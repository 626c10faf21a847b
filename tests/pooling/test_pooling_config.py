"""`ModelConfig` / `PoolingConfig` / `read_st_config`: defaults come from the model directory; bad values are refused."""

from __future__ import annotations

import json
import shutil

import pytest

from services.pooling.__main__ import parse_args
from services.pooling.config import CROSS_ENCODER, EMBEDDING, LLM_JUDGE, ModelConfig, PoolingConfig
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
    config = ModelConfig(model_dir=minilm_dir)
    assert config.kind == EMBEDDING
    assert config.pooling_mode == "mean"
    assert config.normalize is True  # modules.json has a Normalize module
    assert config.max_input_length == 256  # sentence_bert_config.json, not the tokenizer's 512
    assert config.model_name == "all-minilm-l6-v2"
    assert (config.is_matryoshka, config.matryoshka_dimensions, config.prompts) == (False, (), {})
    service = PoolingConfig(models=[config])
    assert (service.max_batch_size, service.dynamic_batching, service.default_model) == (64, True, config)


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
    config = ModelConfig(model_dir=d)
    assert (config.pooling_mode, config.normalize) == (mode, False)


def test_normalize_module_and_sbert_config(tmp_path):
    d = _model_dir(tmp_path)
    _st_files(d, {"pooling_mode_cls_token": True}, normalize=True)
    _write(d / "sentence_bert_config.json", {"max_seq_length": 40, "do_lower_case": True})
    config = ModelConfig(model_dir=d)
    assert (config.pooling_mode, config.normalize, config.max_input_length, config.do_lower_case) == ("cls", True, 40, True)


@pytest.mark.parametrize("pooling", [{"pooling_mode_max_tokens": True},
                                     {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
                                     {"pooling_mode_mean_tokens": False}])
def test_unsupported_or_ambiguous_pooling_is_refused(tmp_path, pooling):
    d = _model_dir(tmp_path)
    _st_files(d, pooling, normalize=False)
    with pytest.raises(ValueError, match="pooling mode"):
        ModelConfig(model_dir=d)


def test_overrides_win_over_the_model(minilm_dir):
    config = ModelConfig(model_dir=minilm_dir, pooling_mode="cls", normalize=False, max_input_length=512)
    assert (config.pooling_mode, config.normalize, config.max_input_length) == ("cls", False, 512)


@pytest.mark.parametrize("tokenizer_max, expected", [(512, 64), (32, 32), (None, 64), (10**30, 64)])
def test_plain_transformers_dir_limit_is_tokenizer_capped_by_positions(tmp_path, tokenizer_max, expected):
    d = _model_dir(tmp_path, max_positions=64, tokenizer_max=tokenizer_max)
    config = ModelConfig(model_dir=d)
    assert config.max_input_length == expected
    # as sentence-transformers wraps a plain model: mean pooling, no Normalize module
    assert (config.pooling_mode, config.normalize, config.model_name) == ("mean", False, "tiny-encoder")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_input_length": 0}, "max_input_length must be >= 1, got 0"),
    ({"max_input_length": 513}, "513 exceeds the model's max_position_embeddings 512"),
    ({"pooling_mode": "max"}, "pooling_mode must be one of"),
    ({"kind": "classifier"}, "kind must be one of"),
    ({"matryoshka_dimensions": (64, 999)}, "matryoshka dimension 999 is outside 1..384"),
])
def test_invalid_values_are_refused(minilm_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(model_dir=minilm_dir, **kwargs)


def test_missing_model_dir_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig(model_dir=tmp_path / "absent")


def test_cli_flags_map_onto_the_config(minilm_dir, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(minilm_dir, d, ignore=shutil.ignore_patterns("*.safetensors"))
    config = parse_args(["--address", "0.0.0.0:6000", "--model-dir", str(d), "--max-batch-size", "8",
                         "--max-input-length", "100", "--pooling-mode", "last", "--no-normalize",
                         "--no-dynamic-batching", "--max-batch-tokens", "512", "--max-wait-ms", "5",
                         "--max-queue-size", "32", "--matryoshka-dimensions", "64,128"])
    model = config.models[0]
    assert (config.address, config.max_batch_size, config.dynamic_batching, config.max_batch_tokens,
            config.max_wait_ms, config.max_queue_size) == ("0.0.0.0:6000", 8, False, 512, 5.0, 32)
    assert (model.model_dir, model.max_input_length, model.pooling_mode, model.normalize, model.model_name,
            model.matryoshka_dimensions, model.is_matryoshka) == (d, 100, "last", False, "copy", (64, 128), True)
    assert parse_args(["--model-dir", str(d)]).models[0].normalize is True
    assert parse_args(["--model-dir", str(d), "--normalize", "--pooling-mode", "mean"]).models[0].normalize is True
    assert parse_args([]).models[0].model_name == "all-minilm-l6-v2"  # the prepared default
    with pytest.raises(SystemExit):
        parse_args(["--model-dir", str(d), "--max-batch-size", "0"])


def _copy(src, dst, **config_edits):
    """A weightless copy of a model directory with config.json edited."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    _write(dst / "config.json", {**config, **config_edits})
    return dst


def test_kinds_and_several_models(minilm_dir, tmp_path):
    ce = _copy(minilm_dir, tmp_path / "ce", architectures=["BertForSequenceClassification"])
    judge = _copy(minilm_dir, tmp_path / "judge", architectures=["LlamaForCausalLM"], classifier_from_token=["N", "Y"])
    config = parse_args(["--model-dir", str(minilm_dir), "--reranker-dir", str(ce), "--judge-dir", str(judge),
                         "--judge-instruction", "Find facts"])
    assert [(m.model_name, m.kind) for m in config.models] == \
        [("all-minilm-l6-v2", EMBEDDING), ("ce", CROSS_ENCODER), ("judge", LLM_JUDGE)]
    assert ModelConfig(model_dir=ce).kind == CROSS_ENCODER  # inferred from the architecture
    assert (config.models[2].judge_tokens, config.models[2].judge_instruction) == (("Y", "N"), "Find facts")
    assert "{document}" in config.models[2].judge_template
    assert parse_args(["--reranker-dir", str(ce)]).models[0].kind == CROSS_ENCODER  # no default embedder added


def test_causal_decoder_defaults_to_last_token_pooling(minilm_dir, tmp_path):
    d = _copy(minilm_dir, tmp_path / "dec", architectures=["LlamaForCausalLM"])
    for name in ("modules.json", "1_Pooling/config.json"):
        (d / name).unlink()
    assert ModelConfig(model_dir=d).pooling_mode == "last"


def test_matryoshka_and_prompts_from_the_model(minilm_dir, tmp_path):
    d = _copy(minilm_dir, tmp_path / "mrl", matryoshka_dimensions=[64, 128, 384])
    _write(d / "config_sentence_transformers.json", {"prompts": {"query": "query: ", "document": "passage: "},
                                                     "default_prompt_name": "query"})
    config = ModelConfig(model_dir=d)
    assert (config.is_matryoshka, config.matryoshka_dimensions) == (True, (64, 128, 384))
    assert (config.prompts, config.default_prompt_name) == ({"query": "query: ", "document": "passage: "}, "query")
    assert ModelConfig(model_dir=_copy(minilm_dir, tmp_path / "any", is_matryoshka=True)).is_matryoshka


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch_size": 0}, r"max_batch_size \(0\) and max_request_chars \(2000000\) must be >= 1"),
    ({"max_request_chars": 0}, r"max_request_chars \(0\) must be >= 1"),
    ({"address": "50054"}, "host:port"),
    ({"max_batch_tokens": 100}, "max_batch_tokens 100 is below the longest max_input_length 256"),
    ({"max_queue_size": 64}, "max_queue_size 64 must hold one full request"),
    ({"max_wait_ms": -1}, "max_wait_ms must be >= 0"),
    ({"models": []}, "at least one model"),
])
def test_invalid_service_values_are_refused(minilm_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolingConfig(**{"models": [ModelConfig(model_dir=minilm_dir)], **kwargs})


def test_duplicate_model_names_are_refused(minilm_dir):
    with pytest.raises(ValueError, match="unique"):
        PoolingConfig(models=[ModelConfig(model_dir=minilm_dir), ModelConfig(model_dir=minilm_dir)])


def test_served_model_name_names_the_first_model_and_its_aliases(minilm_dir, tmp_path):
    ce = _copy(minilm_dir, tmp_path / "ce", architectures=["BertForSequenceClassification"])
    config = parse_args(["--model-dir", str(minilm_dir), "--reranker-dir", str(ce),
                         "--served-model-name", "sentence-transformers/all-MiniLM-L6-v2", "minilm"])
    first, reranker = config.models
    assert (first.model_name, first.aliases) == ("sentence-transformers/all-MiniLM-L6-v2", ("minilm",))
    assert (reranker.model_name, reranker.aliases) == ("ce", ())
    assert config.model_names() == {"sentence-transformers/all-MiniLM-L6-v2": first.model_name,
                                    "minilm": first.model_name, "ce": "ce"}
    only_reranker = parse_args(["--reranker-dir", str(ce), "--served-model-name", "org/ce"])
    assert [m.model_name for m in only_reranker.models] == ["org/ce"]  # no embedding model: the first reranker
    with pytest.raises(SystemExit):
        parse_args(["--served-model-name", "a", "a"])  # a name twice
    with pytest.raises(ValueError, match="must be unique"):  # an alias that is another model's name
        PoolingConfig(models=[ModelConfig(model_dir=minilm_dir, aliases=("ce",)), ModelConfig(model_dir=ce)])
    with pytest.raises(ValueError, match="non-empty and distinct"):
        ModelConfig(model_dir=minilm_dir, aliases=("",))
