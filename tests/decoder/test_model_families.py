"""Model loading by family: config.json's model_type picks the model file; unsupported configs are refused."""

import json

import pytest
import torch
from decoder_testing import make_tiny_llama

from services.decoder.model_llama import LlamaForCausalLM
from services.decoder.model_qwen2 import Qwen2ForCausalLM
from services.decoder.model_qwen3 import Qwen3Attention, Qwen3ForCausalLM
from services.decoder.models import load_model


@pytest.mark.parametrize("family, cls", [("llama", LlamaForCausalLM), ("qwen2", Qwen2ForCausalLM),
                                         ("qwen3", Qwen3ForCausalLM)])
def test_model_type_picks_the_family_file(tmp_path, family, cls):
    model = load_model(make_tiny_llama(tmp_path / family, family=family), torch.float32)
    assert type(model) is cls
    attention = model.model.layers[0].self_attn
    assert (attention.qkv_proj.bias is not None, attention.o_proj.bias is not None) == (family == "qwen2", False)
    assert isinstance(attention, Qwen3Attention) == (family == "qwen3")
    assert hasattr(attention, "q_norm") == (family == "qwen3")


@pytest.mark.parametrize("edit, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"model_type": "llama", "layer_types": ["sliding_attention", "full_attention"]},
     "sliding-window attention layers are not supported"),  # Llama has none (Qwen2/Qwen3/Mistral serve them)
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "RoPE scaling 'longrope' is not supported"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, edit, message):
    directory = make_tiny_llama(tmp_path / "m", family="qwen2")
    config = json.loads((directory / "config.json").read_text())
    config.update(edit)
    if "rope_scaling" in edit:
        config.pop("rope_parameters", None)  # transformers 5 writes rope_parameters; drop it to test the old field
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(directory, torch.float32)
