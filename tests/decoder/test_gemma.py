"""Gemma, Gemma 2 and Gemma 3 text (services/decoder/model_gemma.py) against transformers 5.

Each family is a tiny seeded 2-layer checkpoint: Gemma with head_dim 128 and tied embeddings;
Gemma 2 with head_dim 64, a local (sliding, window 24) then a global layer, attention soft-cap 5
and final soft-cap 5, query_pre_attn_scalar 48; Gemma 3 with head_dim 128, local then global,
window 24, local RoPE base 1e4, global base 1e6 with linear scaling 4, q/k norms, final soft-cap 5.
Prompts of 40-100 tokens and 64 new tokens cross the window. Every regime of family_conformance
(alone, concurrent, chunked, prefix hit, preemption) equals transformers' greedy ids and fp32
logits within 1e-4; the caps and the window change transformers' logits (so matching them proves
the engine applies them); a PEFT LoRA on all linears serves as PEFT; config variants and refusals.
"""

import json
import shutil

import pytest
import torch
from decoder_testing import make_tiny_llama
from family_conformance import LORA_TARGETS, PROMPTS, REGIMES, check_lora, check_regime, references
from transformers import AutoModelForCausalLM

from services.common.checkpoint import check_decoder_dir
from services.decoder.model_gemma import FULL, SLIDING, GemmaForCausalLM, GemmaSpec
from services.decoder.models import family_class, load_model

SOFT_CAP, FINAL_CAP, WINDOW = 5.0, 5.0, 24
# untied for Gemma 2 and 3: tied random tiny ones repeat one token forever, which would prove little
_TINY = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
FAMILIES = {
    "gemma": dict(_TINY, head_dim=128, tie_word_embeddings=True),
    "gemma2": dict(_TINY, head_dim=64, sliding_window=WINDOW, attn_logit_softcapping=SOFT_CAP,
                   final_logit_softcapping=FINAL_CAP, query_pre_attn_scalar=48),
    "gemma3_text": dict(_TINY, head_dim=128, sliding_window=WINDOW, layer_types=[SLIDING, FULL],
                        final_logit_softcapping=FINAL_CAP, query_pre_attn_scalar=96,
                        rope_parameters={FULL: dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                                         SLIDING: dict(rope_type="default", rope_theta=1e4)}),
}


def _tiny(path, family, **overrides):
    return make_tiny_llama(path, seed=11, family=family, **{**FAMILIES[family], **overrides})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> (model dir, transformers' {prompt tuple: (ids, fp32 logits)}), built on first use."""
    cases = {}

    def get(family):
        if family not in cases:
            model_dir = _tiny(tmp_path_factory.mktemp(family), family)
            cases[family] = model_dir, references(model_dir)
        return cases[family]
    return get


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, made):
    """(family, model dir, references) for each family."""
    return (request.param, *made(request.param))


def test_model_type_loads_the_gemma_file(case):
    family, model_dir, _ = case
    assert check_decoder_dir(model_dir).model_type == family
    assert type(load_model(model_dir, torch.float32)) is GemmaForCausalLM is family_class(family)


@pytest.mark.parametrize("regime", REGIMES)
def test_each_regime_equals_transformers(case, regime):
    _, model_dir, refs = case
    check_regime(model_dir, refs, regime)


def test_the_c_pointwise_kernels_leave_gemma_math(made):
    """linear_backend "cpu" hands the C RMSNorm / SiLU gate / rotary to every module with a
    `pointwise` slot: Gemma 3's (1 + w) norms, q/k norms and GeGLU keep their own math."""
    model_dir, refs = made("gemma3_text")
    check_regime(model_dir, refs, "concurrent", linear_backend="cpu")


def _edited(model_dir, tmp_path, **edits):
    """A copy of `model_dir` whose config.json has `edits` (None removes the feature)."""
    copy = tmp_path / "edited"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(edits)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def _teacher_forced_logits(model_dir, prompt, ids):
    """transformers' fp32 logits for each of `ids` after `prompt` [len(ids), vocab], in one forward."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(ids)]


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_soft_caps_and_window_are_visible_in_the_logits(tmp_path, made, family):
    """transformers' logits (which every regime above matches within 1e-4) are those without the
    final cap, capped: bounded by it and changed by it. Removing Gemma 2's attention cap or the
    window (every layer global) changes them too. The engine's lm_head caps as transformers does."""
    model_dir, refs = made(family)
    prompt = PROMPTS[-1]
    ids, ref_logits = refs[tuple(prompt)]
    assert ref_logits.abs().max() <= FINAL_CAP
    baseline = _teacher_forced_logits(model_dir, prompt, ids)  # [64, vocab]
    torch.testing.assert_close(baseline, ref_logits, atol=1e-4, rtol=0)
    uncapped = _teacher_forced_logits(_edited(model_dir, tmp_path / "final", final_logit_softcapping=None), prompt, ids)
    assert uncapped.abs().max() > FINAL_CAP * 1.2
    torch.testing.assert_close(FINAL_CAP * torch.tanh(uncapped / FINAL_CAP), baseline, atol=1e-5, rtol=0)
    variants = {"window": dict(layer_types=[FULL, FULL])}
    if family == "gemma2":
        variants["attention cap"] = dict(attn_logit_softcapping=None)
    for name, edit in variants.items():
        logits = _teacher_forced_logits(_edited(model_dir, tmp_path / name.replace(" ", "-"), **edit), prompt, ids)
        assert (logits - baseline).abs().max() > 1e-2, f"removing the {name} was meant to change the logits"

    model = load_model(model_dir, torch.float32)
    with torch.no_grad():
        hidden = torch.randn(4, model.spec.hidden_size)
        raw = model.lm_head(model.model.norm(hidden))  # [4, vocab]
        assert raw.abs().max() > FINAL_CAP
        torch.testing.assert_close(model.compute_logits(hidden), FINAL_CAP * torch.tanh(raw / FINAL_CAP))


def test_peft_lora_on_all_linears_equals_peft(made):
    """Gemma 2 (window, both caps) with two all-linear adapters and base rows in one batch."""
    check_lora(made("gemma2")[0], LORA_TARGETS["all-linear"])


def test_legacy_gemma3_config_reads_as_transformers(tmp_path):
    """A Hub-style Gemma 3 config: sliding_window_pattern, rope_theta, rope_local_base_freq and a
    legacy rope_scaling (global layers only), no layer_types."""
    config = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=512, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=64, sliding_window_pattern=2, sliding_window=512, rope_theta=1e6,
                  rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    spec = GemmaSpec.from_config(config)
    assert spec.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert (spec.rope_theta, spec.local_rope_theta, spec.local_rope_scaling) == (1e6, 1e4, None)
    assert spec.rope_scaling.rope_type == "linear"
    assert spec.rope_scaling.inv_freq[0] == pytest.approx(1 / 8)
    assert (spec.query_pre_attn_scalar, spec.attn_logit_softcapping, spec.final_logit_softcapping) == (256, None, None)
    assert spec.qk_norm and spec.sandwich_norms and spec.tie_word_embeddings
    gemma2 = GemmaSpec.from_config(dict(config, model_type="gemma2", architectures=["Gemma2ForCausalLM"]))
    assert gemma2.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)  # Gemma2Config's defaults


def test_gemma1_legacy_gelu_is_the_tanh_gelu(tmp_path, made):
    """Gemma 1 checkpoints say hidden_act "gelu"; transformers' GemmaConfig reads it as gelu_pytorch_tanh."""
    model_dir = _edited(made("gemma")[0], tmp_path, hidden_act="gelu")
    check_decoder_dir(model_dir)
    spec = GemmaSpec.from_config(json.loads((model_dir / "config.json").read_text()))
    assert spec.query_pre_attn_scalar is None and not spec.sandwich_norms and spec.layer_types == (FULL, FULL)


@pytest.mark.parametrize("family, edit, message", [
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention is not supported"),
    ("gemma3_text", dict(rope_parameters={FULL: dict(rope_type="longrope", rope_theta=1e6, short_factor=[1.0] * 32,
                                                     long_factor=[1.0] * 32, original_max_position_embeddings=64),
                                          SLIDING: dict(rope_type="default", rope_theta=1e4)}),
     r"rope_parameters\['full_attention'\]: RoPE scaling 'longrope' is not supported"),
    ("gemma2", dict(layer_types=[SLIDING, "chunked_attention"]), "layer_types .* is not supported"),
])
def test_unservable_configs_are_refused_by_name(family, edit, message):
    config = dict(model_type=family, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, **edit)
    with pytest.raises(ValueError, match=message):
        GemmaSpec.from_config(config)
