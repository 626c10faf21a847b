"""`tessera models export-gguf`: transformers reads the GGUF back to the very weights, tokens and greedy ids."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tessera.cli.gguf_export import export_gguf, permute_for_ggml
from tessera.cli.main import main
from tessera.paths import default_decoder_dir

PROMPT = "The capital of France is"
TENSORS = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight", "model.norm.weight")


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A random 2-layer LlamaForCausalLM (hidden 32, 4 heads, 2 KV heads) with the SmolLM2 tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    directory = tmp_path_factory.mktemp("tiny-llama") / "tiny-llama"
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(default_decoder_dir())).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def smollm2():
    return AutoModelForCausalLM.from_pretrained(str(default_decoder_dir()), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "smollm2-F32.gguf"
    assert main(["models", "export-gguf", "--dir", str(default_decoder_dir()), "--out", str(out)]) == 0
    return out


def test_transformers_loads_the_f32_gguf_to_the_same_weights_and_greedy_ids(smollm2, exported):
    loaded = AutoModelForCausalLM.from_pretrained(str(exported.parent), gguf_file=exported.name,
                                                  dtype=torch.float32).eval()
    original, reread = smollm2.state_dict(), loaded.state_dict()
    for name in TENSORS:  # q/k went through llama.cpp's permutation and back
        assert torch.equal(reread[name], original[name]), name
    tokenizer = AutoTokenizer.from_pretrained(str(default_decoder_dir()))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = smollm2.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(loaded.generate(ids, max_new_tokens=8, do_sample=False), expected)
    gguf_tokenizer = AutoTokenizer.from_pretrained(str(exported.parent), gguf_file=exported.name)
    text = "Ünïcode 🚀 and code: def f(x): return x**2"
    assert gguf_tokenizer.encode(text) == tokenizer.encode(text)


def test_permutation_interleaves_each_heads_rotary_halves():
    # 2 heads of dim 4: rows (x0 x1 y0 y1) per head become (x0 y0 x1 y1)
    weight = torch.arange(8.0).unsqueeze(1)
    assert permute_for_ggml(weight, 2).squeeze(1).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_bf16_keeps_norms_f32_and_rounds_matrices(tmp_path, tiny_llama_dir):
    import gguf

    out = export_gguf(tiny_llama_dir, tmp_path / "tiny-BF16.gguf", "bf16")
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.ffn_up.weight"] == gguf.GGMLQuantizationType.BF16
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_BF16


def test_unknown_outtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="outtype must be one of"):
        export_gguf(default_decoder_dir(), tmp_path / "x.gguf", "q5_k")
