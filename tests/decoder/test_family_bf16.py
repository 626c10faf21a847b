"""Every native family served in bfloat16 against transformers in bfloat16 (the README's bf16 rule,
family_conformance.bf16_follows): logits within 8 bf16 ulps of the row's largest up to the first
divergence, divergences only where transformers' own top two logits tie within rounding, and greedy
ids equal up to transformers' first tie for all prompts but at most one. fp32 stays the exact
reference in each family's own tests."""

import pytest
from decoder_testing import make_tiny_llama
from family_conformance import PROMPTS, check_bf16

_TINY = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
FAMILIES = {
    "llama": dict(_TINY, rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_position_embeddings=64,
                                              rope_theta=10000.0)),
    "mistral": dict(_TINY, sliding_window=24),
    "qwen2": dict(_TINY),
    "qwen3": dict(_TINY, head_dim=128),
    "gemma": dict(_TINY, tie_word_embeddings=True),
    "gemma2": dict(_TINY, sliding_window=24, attn_logit_softcapping=5.0, final_logit_softcapping=5.0,
                   query_pre_attn_scalar=48),
    "gemma3_text": dict(_TINY, sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                        final_logit_softcapping=5.0),
    "phi3": dict(_TINY, partial_rotary_factor=0.75),
    "smollm3": dict(_TINY, no_rope_layers=[1, 0]),
    "granite": dict(_TINY, embedding_multiplier=3.0, attention_multiplier=0.05, residual_multiplier=0.6,
                    logits_scaling=2.5),
    "olmo2": dict(_TINY),
    "mixtral": dict(_TINY, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(_TINY, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "qwen2_moe": dict(_TINY, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                      shared_expert_intermediate_size=80),
}
BF16_PROMPTS = PROMPTS[1:4]  # 40, 70 and 90 tokens: past the 24-token windows


@pytest.mark.parametrize("family", FAMILIES)
def test_family_in_bf16_follows_transformers_bf16(tmp_path, family):
    model_dir = make_tiny_llama(tmp_path / family, seed=5, family=family, **FAMILIES[family])
    equal = check_bf16(model_dir, BF16_PROMPTS, new_tokens=16)
    assert equal >= len(BF16_PROMPTS) - 1, f"greedy ids equal (up to a bf16 tie) for {equal} of {len(BF16_PROMPTS)}"
