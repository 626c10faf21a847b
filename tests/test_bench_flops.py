"""bench/_flops.py counts a mixture-of-experts model's work as it runs: the k experts a token is routed
to (plus router and shared expert) per token, every expert in what a step stores and reads."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _flops import ModelShape  # noqa: E402


def _shape(tmp_path: Path, **config) -> ModelShape:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelShape.read(tmp_path)


def test_mixtral_8x7b_counts_two_experts_per_token_and_eight_stored(tmp_path):
    shape = _shape(tmp_path, model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                   num_experts_per_tok=2)
    attention = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
    assert shape.linear_params == attention + 32 * (2 * 3 * 4096 * 14336 + 4096 * 8)  # 12.6e9: Mixtral's ~12.9B active
    assert shape.weight_params == attention + 32 * (8 * 3 * 4096 * 14336 + 4096 * 8)  # 46.4e9 of its 46.7B


def test_qwen_moe_dense_layers_and_shared_expert(tmp_path):
    shape = _shape(tmp_path, model_type="qwen2_moe", hidden_size=64, intermediate_size=100, num_hidden_layers=4,
                   num_attention_heads=4, vocab_size=10, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=20,
                   shared_expert_intermediate_size=40, decoder_sparse_step=2, mlp_only_layers=[])
    attention = 4 * 4 * 64 * 64
    shared = 3 * 64 * 40 + 64
    assert shape.sparse_layers == 2  # layers 1 and 3
    assert shape.linear_params == attention + 2 * 3 * 64 * 100 + 2 * (2 * 3 * 64 * 20 + 64 * 8 + shared)
    assert shape.weight_params == attention + 2 * 3 * 64 * 100 + 2 * (8 * 3 * 64 * 20 + 64 * 8 + shared)


def test_a_dense_model_stores_what_a_token_multiplies(tmp_path):
    shape = _shape(tmp_path, model_type="llama", hidden_size=64, intermediate_size=100, num_hidden_layers=2,
                   num_attention_heads=4, vocab_size=10)
    assert shape.linear_params == shape.weight_params == 2 * (4 * 64 * 64 + 3 * 64 * 100)
