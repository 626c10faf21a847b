"""A user's own config.json is checked before any weight is read: every value the decoder cannot
serve is refused in one line naming the field (a traceback, a hang at the first request or silently
wrong numbers otherwise), and RoPE settings are read as transformers reads them."""

from __future__ import annotations

import json
import math

import pytest
from transformers import AutoConfig

from services.common.checkpoint import check_decoder_dir, rope_settings
from services.common.errors import InvalidArgument
from tessera.paths import default_decoder_dir

BASE = json.loads((default_decoder_dir() / "config.json").read_text())


def _checkpoint(directory, config) -> object:
    """A directory check_decoder_dir reads: config.json as given (a dict, or raw text), and the
    weight and tokenizer files it looks for (empty: the check reads config.json only)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"")
    (directory / "tokenizer.json").write_text("{}")
    return directory


def _edited(**changes) -> dict:
    config = {**BASE, **changes}
    return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize("config, message", [
    ("[1, 2]", "config.json holds a JSON list, not an object"),
    (json.dumps(_edited(hidden_size=math.inf)), "config.json's hidden_size must be an integer, got inf"),
    (_edited(hidden_size=[576]), "config.json's hidden_size must be an integer, got [576]"),
    (_edited(hidden_size=576.0), "config.json's hidden_size must be an integer, got 576.0"),
    (_edited(num_hidden_layers=True), "config.json's num_hidden_layers must be an integer, got True"),
    (_edited(hidden_size=0), "config.json's hidden_size is 0; it must be at least 1"),
    (_edited(num_key_value_heads=-3), "config.json's num_key_value_heads is -3; it must be at least 1"),
    (_edited(max_position_embeddings=0), "config.json's max_position_embeddings is 0; it must be at least 1"),
    (_edited(vocab_size=None), "config.json has no vocab_size"),
    (_edited(intermediate_size=None), "config.json has no intermediate_size"),
    (_edited(num_key_value_heads=2), "num_attention_heads 9 is not a multiple of num_key_value_heads 2"),
    (_edited(num_attention_heads=7, num_key_value_heads=7, head_dim=None),
     "hidden_size 576 does not split into num_attention_heads 7 heads, and there is no head_dim"),
    (_edited(head_dim=63), "head_dim 63 is odd"),
    (_edited(hidden_act="gelu"), "config.json's hidden_act is 'gelu'; llama is served with 'silu'"),
    (_edited(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "RoPE scaling 'longrope' is not supported: "
                                                                     "it is served for Phi-3 (model_type 'phi3') only"),
    (_edited(rope_scaling={"type": "ntk", "factor": 2.0}), "RoPE scaling 'ntk' is not supported: the served types"),
    (_edited(rope_parameters={"rope_type": "default", "rope_theta": 0}),
     "config.json's rope_theta must be a positive finite number, got 0"),
    (_edited(rope_parameters="default"), "config.json's rope_parameters must be an object"),
    (_edited(rms_norm_eps=-1.0), "config.json's rms_norm_eps must be a positive finite number, got -1.0"),
    (_edited(dtype="float99"), "config.json's dtype is 'float99', not a torch dtype name"),
    (_edited(architectures="LlamaForCausalLM"), "config.json's architectures must be a list of names"),
])
def test_values_the_decoder_cannot_serve_are_refused_naming_the_field(tmp_path, config, message):
    directory = _checkpoint(tmp_path / "model", config)
    with pytest.raises(InvalidArgument) as refusal:
        check_decoder_dir(directory)
    assert str(refusal.value).startswith(f"decoder model dir {str(directory)!r}: ")
    assert message in str(refusal.value), str(refusal.value)


def test_the_prepared_checkpoint_and_transformers_spellings_pass(tmp_path):
    assert check_decoder_dir(default_decoder_dir()).head_dim == 64
    for i, changes in enumerate([{"torch_dtype": "torch.bfloat16"}, {"dtype": "auto"},
                                 {"rope_scaling": {"type": "default"}}, {"head_dim": 64, "num_attention_heads": 8,
                                                                          "num_key_value_heads": 8}]):
        check_decoder_dir(_checkpoint(tmp_path / str(i), _edited(**changes)))


@pytest.mark.parametrize("changes", [
    {},                                                                          # rope_parameters only
    {"rope_theta": 5000.0},                                                      # and a top-level theta
    {"rope_scaling": {"rope_type": "default"}},                                  # a legacy field replaces it
    {"rope_scaling": {"rope_type": "default", "rope_theta": 2500.0}},
    {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 20000.0},
    {"rope_parameters": None, "rope_theta": 7000.0},
    {"rope_parameters": None},
])
def test_rope_settings_are_read_as_transformers_reads_them(tmp_path, changes):
    """Both rope_parameters and a legacy rope_scaling: transformers uses rope_scaling (and the top-level
    or default theta); tessera had used rope_parameters and served the wrong positions silently."""
    config = _edited(**changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = AutoConfig.from_pretrained(tmp_path).rope_parameters
    assert rope_settings(config) == (reference["rope_type"], reference["rope_theta"])
