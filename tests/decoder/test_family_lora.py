"""All-linear PEFT adapters on the native families whose own tests cover q/v only: two adapters and
base rows in one batch = PEFT (family_conformance.check_lora). Mistral, Gemma 2, Phi-3 and the MoE
families test their all-linear (or widest) adapters in their own files."""

import pytest
from decoder_testing import make_tiny_llama
from family_conformance import LORA_TARGETS, PROMPTS, check_lora

FAMILIES = {
    "qwen3": dict(head_dim=64),
    "smollm3": dict(head_dim=64, no_rope_layers=[1, 0]),
    "granite": dict(head_dim=64, embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5,
                    logits_scaling=2.0),
    "olmo2": dict(head_dim=64),
    "gemma3_text": dict(head_dim=64, sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_all_linear_adapters_equal_peft(tmp_path, family):
    model_dir = make_tiny_llama(tmp_path / family, seed=11, family=family, **FAMILIES[family])
    check_lora(model_dir, LORA_TARGETS["all-linear"], prompts=[PROMPTS[3]])
