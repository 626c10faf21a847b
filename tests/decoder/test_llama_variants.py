"""SmolLM3, Granite 3 and OLMo 2, the Llama block with a difference each, against transformers 5.

Each family runs on a tiny seeded 2-layer checkpoint built by transformers: SmolLM3 with head_dim 64,
layer 0 rotating with full attention and layer 1 a NoPE layer with a 32-key sliding window (prompts
run to 100 tokens and 64 more are generated); Granite with head_dim 128 and every multiplier away from
1; OLMo 2 with head_dim 128 (its q/k norms span 256 and 128 columns). In every regime of
family_conformance (alone, concurrent, chunked, prefix hit, preemption) greedy ids for 64 new
tokens equal transformers' generate and fp32 logits agree within 1e-4; two PEFT LoRA adapters on
q/v and base rows in one batch equal PEFT. SmolLM3 sliding layers without a window are refused in one
line, and `check_decoder_dir` (what `tessera up` and `tessera info` run) accepts each checkpoint.
"""

import json

import pytest
import torch
from decoder_testing import make_tiny_llama
from family_conformance import PROMPTS, REGIMES, check_lora, check_regime, references

from services.common.checkpoint import check_decoder_dir
from services.decoder.model_granite import GraniteForCausalLM
from services.decoder.model_olmo2 import Olmo2ForCausalLM
from services.decoder.model_smollm3 import SmolLM3ForCausalLM
from services.decoder.models import load_model

GRANITE_MULTIPLIERS = dict(embedding_multiplier=3.0, attention_multiplier=0.05, residual_multiplier=0.6,
                           logits_scaling=2.5)
CASES = {
    "smollm3": (SmolLM3ForCausalLM, dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                         no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=32)),
    "granite": (GraniteForCausalLM, dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                         **GRANITE_MULTIPLIERS)),
    "olmo2": (Olmo2ForCausalLM, dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=128)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(family, model dir, {prompt tuple: (ref ids, ref fp32 logits [n, vocab])})."""
    family = request.param
    model_dir = make_tiny_llama(tmp_path_factory.mktemp(family), seed=3, family=family, **CASES[family][1])
    return family, model_dir, references(model_dir)


def test_the_family_file_reads_its_difference(case):
    family, model_dir, _ = case
    model = load_model(model_dir, torch.float32)
    assert type(model) is CASES[family][0]
    if family == "smollm3":
        assert [layer.self_attn.use_rope for layer in model.model.layers] == [True, False]
        assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, 32]
    elif family == "granite":
        assert {name: getattr(model.spec, name) for name in GRANITE_MULTIPLIERS} == GRANITE_MULTIPLIERS
        assert model.model.layers[0].self_attn.scale == 0.05
    else:
        layer = model.model.layers[0]
        assert not hasattr(layer, "input_layernorm") and hasattr(layer, "post_feedforward_layernorm")
        assert layer.self_attn.q_norm.weight.shape == (256,) and layer.self_attn.k_norm.weight.shape == (128,)
    assert check_decoder_dir(model_dir).model_type == family


@pytest.mark.parametrize("regime", REGIMES)
def test_greedy_and_logits_equal_transformers(case, regime):
    """chunked and preempt run the C GEMM, RMSNorm, rotary and SiLU gate (linear_backend "cpu"), so
    they are checked to compute each family's math; the other regimes run what "auto" picks."""
    _, model_dir, refs = case
    check_regime(model_dir, refs, regime, **(dict(linear_backend="cpu") if regime in ("chunked", "preempt") else {}))


def test_lora_q_v_equals_peft(case):
    """Adapter a, the base and adapter b on a 90-token prompt in one batch."""
    _, model_dir, _ = case
    check_lora(model_dir, ["q_proj", "v_proj"], prompts=[PROMPTS[3]])


def test_smollm3_sliding_layers_without_a_window_are_refused_in_one_line(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "m", family="smollm3", no_rope_layers=[1, 0])
    config = json.loads((model_dir / "config.json").read_text())
    config.update(layer_types=["full_attention", "sliding_attention"], sliding_window=None)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^config.json's sliding_window must be a positive integer for the "
                                         r"sliding_attention layers \[1\], got None$"):
        load_model(model_dir, torch.float32)


def test_olmo2_bf16_norm_and_rotary_round_as_transformers():
    """OLMo 2 rounds once after scaling in float32 (norms) and after rotating in float32 (RoPE), where
    Llama rounds before the scale and rotates in bf16: bit-equal to transformers' modules in bf16."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm as HFOlmo2RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import apply_rotary_pos_emb

    from services.decoder.model_llama import RMSNorm
    from services.decoder.model_olmo2 import Olmo2Attention, Olmo2RMSNorm
    from services.decoder.rotary import RotaryEmbedding, apply_rotary

    torch.manual_seed(0)
    x = torch.randn(7, 256).to(torch.bfloat16)  # [tokens, heads * head_dim]
    ours, theirs, llama = Olmo2RMSNorm(256, 1e-5), HFOlmo2RMSNorm(256, 1e-5), RMSNorm(256, 1e-5)
    weight = torch.rand(256) + 0.5
    with torch.no_grad():
        for norm in (ours, theirs, llama):
            norm.weight.copy_(weight)
            norm.to(torch.bfloat16)
        assert torch.equal(ours(x), theirs(x)) and not torch.equal(llama(x), theirs(x))
    q, k = x.view(7, 2, 128), x[:, :128].reshape(7, 1, 128)  # [tokens, heads, head_dim]
    cos, sin = RotaryEmbedding(128, 10000.0).cos_sin(torch.arange(100, 107), torch.float32)
    attention = Olmo2Attention.__new__(Olmo2Attention)
    got = Olmo2Attention.rotate_qk(attention, q, k, cos, sin)
    # transformers' layout: [batch, heads, tokens, head_dim], cos/sin [batch, tokens, head_dim]
    want = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert all(torch.equal(g, w[0].transpose(0, 1)) for g, w in zip(got, want))
    in_bf16 = apply_rotary(q, cos.to(torch.bfloat16), sin.to(torch.bfloat16))  # Llama's order
    assert not torch.equal(in_bf16, want[0][0].transpose(0, 1))
    assert got[0].dtype == torch.bfloat16


@pytest.mark.parametrize("family, cfg", [
    ("smollm3", dict(num_hidden_layers=8)),
    ("smollm3", dict(num_hidden_layers=6, no_rope_layer_interval=3, use_sliding_window=True, sliding_window=16)),
    ("smollm3", dict(num_hidden_layers=4, use_sliding_window=True)),  # no window set: every layer full
    ("olmo2", dict(num_hidden_layers=2)),
    ("granite", dict(num_hidden_layers=2, tie_word_embeddings=True, embedding_multiplier=12)),
])
def test_config_reading_matches_transformers_defaults(family, cfg):
    """What config.json leaves out is read as transformers' config class fills it in."""
    from transformers import AutoConfig

    from services.decoder.models import family_class

    cfg = dict(model_type=family, vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=4, **cfg)
    theirs = AutoConfig.for_model(**cfg)
    spec = family_class(family).spec_from_config(cfg)
    assert (spec.rope_theta, spec.rms_norm_eps, spec.tie_word_embeddings) == (
        theirs.rope_parameters["rope_theta"], theirs.rms_norm_eps, theirs.tie_word_embeddings)
    if family == "smollm3":
        assert spec.no_rope_layers == tuple(theirs.no_rope_layers)
        assert spec.layer_types == tuple(theirs.layer_types)
        assert spec.sliding_window == (theirs.sliding_window if "sliding_attention" in theirs.layer_types else None)
    if family == "granite":
        assert spec.embedding_multiplier == theirs.embedding_multiplier == 12
        assert spec.logits_scaling == theirs.logits_scaling == 1.0
