"""Phi-3 / Phi-4-mini against transformers 5: fused checkpoint projections, partial rotary, longrope.

Two tiny 2-layer Phi3ForCausalLM checkpoints, each in every regime of family_conformance (alone,
concurrent, chunked prefill across position 64, prefix hit, recompute preemption):
- "phi3": head_dim 128, default RoPE, a 48-token sliding window (prompts of 70-100 tokens exceed it);
- "phi4-mini": head_dim 64, partial_rotary_factor 0.75 (48 rotated dims) and longrope (24 short and 24
  long factors, original_max_position_embeddings 64, max_position_embeddings 256), as Phi-4-mini:
  prompts of 70-100 tokens run on the long factors from the first chunk; those of 5 and 40 cross 64
  while decoding, where transformers' generate recomputes the cache on the long factors.
longrope's choice spans the whole forward pass in transformers, so a batched generate would choose
for every row by its longest one: its references come from one generate for the prompts past 64
and one per shorter prompt. A short prompt's cached blocks are not reused by a long one.
A PEFT LoRA on qkv_proj/o_proj (and one on gate_up_proj/down_proj) equals PEFT in one batch with the base.
"""

import asyncio
import json

import pytest
import torch
from decoder_testing import check_greedy, hf_reference, hf_reference_batch, make_tiny_llama, run_requests
from family_conformance import NEW_TOKENS, PREFIX_PROMPT, PROMPTS, REGIMES, check_regime, references
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from services.common.checkpoint import check_decoder_dir
from services.common.errors import InvalidArgument
from services.decoder.adapter_source import InMemoryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.lora import LoRAWeights
from services.decoder.model_phi3 import Phi3ForCausalLM
from services.decoder.models import load_model
from services.decoder.types import GenerateInput, SamplingParams

ORIGINAL = 64  # original_max_position_embeddings of the longrope checkpoint
ROTARY_DIM = 48  # head_dim 64 x partial_rotary_factor 0.75
WINDOW = 48
LORA_TOKENS = 32  # the 40-token prompt crosses ORIGINAL after 25


def _phi3(path):
    return make_tiny_llama(path, seed=11, family="phi3", hidden_size=256, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=128, intermediate_size=256, max_position_embeddings=256,
                           sliding_window=WINDOW)


def _phi4_mini(path):
    pairs = ROTARY_DIM // 2
    rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                short_factor=[1.0 + 0.05 * i for i in range(pairs)], long_factor=[1.5 + 0.4 * i for i in range(pairs)])
    return make_tiny_llama(path, seed=12, family="phi3", hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                           original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
                           rope_parameters=rope)


def _longrope_references(model_dir, prompts):
    """transformers' generate, one call for the prompts past ORIGINAL (all on the long factors from
    the first step) and one per shorter prompt: longrope picks by the longest row of a batch, and
    Phi-3's generate recomputes its cache by the batch's width."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    long_prompts = [p for p in prompts if len(p) > ORIGINAL]
    refs = dict(zip(map(tuple, long_prompts), hf_reference_batch(model, long_prompts, NEW_TOKENS))) if long_prompts \
        else {}
    refs.update((tuple(p), hf_reference(model, p, NEW_TOKENS)) for p in prompts if len(p) <= ORIGINAL)
    return refs


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    model_dir = _phi3(tmp_path_factory.mktemp("phi3"))
    return model_dir, references(model_dir)


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory):
    model_dir = _phi4_mini(tmp_path_factory.mktemp("phi4-mini"))
    return model_dir, _longrope_references(model_dir, PROMPTS + [PREFIX_PROMPT])


def test_checkpoints_are_what_the_tests_claim(phi3, phi4_mini):
    """The fused names are the file's, the rotary table is 48 dims with both factor sets, the window is set."""
    long_dir, _ = phi4_mini
    config = json.loads((long_dir / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "longrope" and config["partial_rotary_factor"] == 0.75
    check_decoder_dir(long_dir)  # `tessera up` serves it
    model = load_model(long_dir, torch.float32)
    assert isinstance(model, Phi3ForCausalLM) and model.spec.rotary_dim == ROTARY_DIM
    hf = AutoModelForCausalLM.from_pretrained(long_dir).eval()
    assert torch.equal(model.rotary.inv_freq, hf.model.rotary_emb.original_inv_freq)
    assert model.rotary.long_rope.original_max_position_embeddings == ORIGINAL
    assert not torch.equal(model.rotary.long_inv_freq, model.rotary.inv_freq)
    layer = load_model(phi3[0], torch.float32).model.layers[0]
    assert layer.self_attn.sliding_window == WINDOW and layer.self_attn.rotary_dim == 128
    assert [name for name, _, _ in layer.self_attn.qkv_proj.lora_slices] == ["model.layers.0.self_attn.qkv_proj"]
    assert [name for name, _, _ in layer.mlp.gate_up_proj.lora_slices] == ["model.layers.0.mlp.gate_up_proj"]


@pytest.mark.parametrize("legacy_type", ["longrope", "yarn"])  # Phi3Config reads a legacy "yarn" as longrope
def test_legacy_rope_scaling_reads_as_transformers(phi4_mini, tmp_path, legacy_type):
    """A config.json as the Phi-3.5 / Phi-4-mini checkpoints ship it (transformers 4: `rope_scaling` with
    the legacy `type`, top-level rope_theta, partial_rotary_factor and original_max_position_embeddings)
    gives transformers' short and long frequencies and attention factor."""
    model_dir, _ = phi4_mini
    for source in model_dir.iterdir():
        (tmp_path / source.name).symlink_to(source)
    config = json.loads((model_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], rope_scaling={"type": legacy_type, "short_factor": rope["short_factor"],
                                                               "long_factor": rope["long_factor"]})
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_decoder_dir(tmp_path)
    rotary = load_model(tmp_path, torch.float32).rotary
    expected = AutoModelForCausalLM.from_pretrained(tmp_path).model.rotary_emb
    assert expected.rope_type == "longrope"
    assert torch.equal(rotary.inv_freq, expected.original_inv_freq)
    assert rotary.attention_scaling == expected.attention_scaling
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](expected.config, "cpu", seq_len=ORIGINAL + 1)
    assert torch.equal(rotary.long_inv_freq, long_inv_freq)
    config["rope_scaling"]["type"] = "su"  # Phi-3's oldest spelling, which transformers 5 fails to read
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument, match="RoPE scaling 'su' is not supported"):
        check_decoder_dir(tmp_path)


@pytest.mark.parametrize("regime", REGIMES)
def test_phi3_head_dim_128_sliding_window(phi3, regime):
    model_dir, refs = phi3
    # the window frees each running request's blocks before it: a smaller pool still forces preemption
    check_regime(model_dir, refs, regime, **({"num_blocks": 11, "block_size": 16} if regime == "preempt" else {}))


@pytest.mark.parametrize("regime", REGIMES)
def test_phi4_mini_partial_rotary_longrope(phi4_mini, regime):
    model_dir, refs = phi4_mini
    # the C rotary kernel (cpu linear backend) on the rotated slice in one regime, torch's in the others
    check_regime(model_dir, refs, regime, **({"linear_backend": "cpu"} if regime == "concurrent" else {}))


def test_short_factor_blocks_are_not_reused_by_a_long_prompt(phi4_mini):
    """The first 40 tokens of the 100-token prompt, cached on the short factors, are not reused by that
    prompt, which runs on the long ones (it still equals transformers); the prefix regime shows
    long-factor blocks reused by another long prompt."""
    model_dir, refs = phi4_mini
    engine = start_engine(DecoderConfig(model_dir=str(model_dir), num_blocks=80, max_model_len=256))
    try:
        run_requests(engine, [GenerateInput(SamplingParams(max_tokens=4), request_id="short",
                                            prompt_token_ids=tuple(PROMPTS[-1][:40]))])
        assert engine.parts.block_manager.num_cached_blocks == 2  # two full 16-token blocks
        long_ = check_greedy(engine, refs, [GenerateInput(SamplingParams(max_tokens=NEW_TOKENS), request_id="long",
                                                          prompt_token_ids=tuple(PROMPTS[-1]))])[0]
    finally:
        engine.shutdown()
    assert long_[2].usage.cached_prompt_tokens == 0


def _peft(model_dir, seed, targets):
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():  # decisive adapters: greedy choices change
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    return model.eval()


def _lora_weights(peft_model, digest):
    """Scaled factors by transformers module name, as the registry serves them."""
    modules, params = {}, dict(peft_model.named_parameters())
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            a = params[f"{name}.lora_A.default.weight"].detach().clone()
            b = params[f"{name}.lora_B.default.weight"].detach().clone() * module.scaling["default"]
            modules[name.removeprefix("base_model.model.")] = (a, b)
    return LoRAWeights(digest, modules)


def test_peft_lora_on_fused_projections_equals_peft(phi4_mini):
    """Adapters on qkv_proj/o_proj and on gate_up_proj/down_proj, with a base request, in one batch."""
    model_dir, refs = phi4_mini
    prompts = [PROMPTS[1], PROMPTS[2]]  # 40 tokens (crosses 64 while decoding), 70 (long from the start)
    attention, mlp = _peft(model_dir, 1, ["qkv_proj", "o_proj"]), _peft(model_dir, 2, ["gate_up_proj", "down_proj"])
    expected = {}
    for name, model in (("attention", attention), ("mlp", mlp)):
        for prompt in prompts:
            expected[name, tuple(prompt)] = hf_reference(model, prompt, LORA_TOKENS)[0]
            assert expected[name, tuple(prompt)] != refs[tuple(prompt)][0][:LORA_TOKENS]
    adapters = InMemoryAdapterSource()
    adapters.add("attention", _lora_weights(attention, "digest-attention"))
    adapters.add("mlp", _lora_weights(mlp, "digest-mlp"))
    engine = start_engine(DecoderConfig(model_dir=str(model_dir), num_blocks=80, max_model_len=256, adapter_slots=2,
                                        max_lora_rank=8), adapters)
    requests = [(name, prompt) for prompt in prompts for name in ("attention", "", "mlp")]
    try:
        async def collect(name, prompt):
            request = GenerateInput(SamplingParams(max_tokens=LORA_TOKENS), prompt_token_ids=tuple(prompt), lora=name)
            return [t async for out in engine.generate(request) for t in out.token_ids]

        async def main():
            return await asyncio.gather(*(collect(name, prompt) for name, prompt in requests))

        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for (name, prompt), ids in zip(requests, results):
        assert ids == (expected[name, tuple(prompt)] if name else refs[tuple(prompt)][0][:LORA_TOKENS]), (name, len(prompt))
