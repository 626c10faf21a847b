"""--kv-cache-dtype bfloat16 on a float32 model (vLLM's flag): K/V rounded to bfloat16 as they are
written, widened as attention reads them, against transformers whose DynamicCache rounds what it stores
the same way (`RoundingCache`), through every attention backend that runs here, the fused decode step
and the module path, in the scheduling regimes; the cache's bytes, its sizing from a memory budget,
its metric, and the refusals. The kernels themselves: test_cpu_attention.py and
test_attention_backends.py (float64 references over a bfloat16 cache), attention_kernel_cases.py
(Triton, in the interpreter subprocess)."""

from __future__ import annotations

import pytest
import torch
from decoder_testing import hf_reference_batch, make_tiny_llama
from family_conformance import PREFIX_PROMPT, PROMPTS, check_regime, references
from transformers import AutoModelForCausalLM, DynamicCache

from services.decoder.config import DecoderConfig
from services.decoder.decode_step import FusedDecode
from services.decoder.engine import LLMEngine, start_engine

NEW_TOKENS = 32


class RoundingCache(DynamicCache):
    """transformers' DynamicCache storing K/V as a bfloat16 cache holds them: rounded to nearest even,
    then widened back to float32, so attention (prefill and decode) reads the rounded values."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(key_states.bfloat16().float(), value_states.bfloat16().float(), layer_idx, *args,
                              **kwargs)


def rounded_references(model_dir, prompts) -> dict:
    """{prompt: (ids, fp32 logits)} from transformers' generate over a `RoundingCache`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    original = model.generate

    def generate(*args, **kwargs):
        return original(*args, cache=RoundingCache(), **kwargs)

    model.generate = generate
    return dict(zip(map(tuple, prompts), hf_reference_batch(model, prompts, NEW_TOKENS)))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama (head_dim 64: the kernels' vector loops), its rounded-cache references, and the
    float32-cache ones."""
    path = make_tiny_llama(tmp_path_factory.mktemp("kv_bf16"), seed=5, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, hidden_size=128)
    prompts = PROMPTS + [PREFIX_PROMPT]
    return path, rounded_references(path, prompts), references(path, prompts, NEW_TOKENS)


# Logits: 1e-4 plus 2^-8 of the step's largest |logit|. The engine's K/V (one fused q/k/v GEMM) and
# transformers' (k_proj, v_proj) differ in float32 summation order; where a value lies within that
# difference of a bfloat16 rounding boundary it rounds the other way, moving one cached element by
# 2^-8 of itself (measured here: up to 7e-3 at |logits| <= 9). A float32 cache is off by ~12 (the ids part).
RTOL = 2 ** -8


def test_the_rounding_reference_differs_from_the_float32_one(model):
    """The references this file checks against are not float32's: greedy ids part, so a cache that kept
    float32 fails the tests below on ids alone."""
    _, rounded, exact = model
    assert sum(rounded[p][0] != exact[p][0] for p in rounded) >= 3


@pytest.mark.parametrize("attention, decode_step", [("cpu", "fused"), ("cpu", "modules"), ("torch", "modules")])
@pytest.mark.parametrize("regime", ["alone", "concurrent", "chunked", "prefix"])
def test_bfloat16_cache_equals_transformers_rounding_cache(model, attention, decode_step, regime, monkeypatch):
    """Greedy ids equal and fp32 logits within `RTOL` of transformers over a rounding cache; the fused
    step ran where asked (the kernels' float32-query / bfloat16-cache variants), every block freed."""
    path, rounded, _ = model
    calls = []
    call = FusedDecode._run
    monkeypatch.setattr(FusedDecode, "_run", lambda self, *a: (calls.append(self), call(self, *a))[1])
    check_regime(path, rounded, regime, new_tokens=NEW_TOKENS, rtol=RTOL, kv_cache_dtype="bfloat16", dtype="float32",
                 attention_backend=attention, decode_step=decode_step, linear_backend="torch")
    assert bool(calls) == (decode_step == "fused")


def test_cache_bytes_budget_and_metric(model):
    """The cache stores bfloat16 (half float32's bytes per block), a memory budget holds twice the
    blocks, and vllm:cache_config_info reports cache_dtype bfloat16."""
    path = str(model[0])
    common = dict(model_dir=path, max_model_len=256, kv_cache_memory_bytes=4 << 20)
    full, half = DecoderConfig(**common), DecoderConfig(**common, kv_cache_dtype="bfloat16")
    assert half.kv_block_layout().bytes_per_block * 2 == full.kv_block_layout().bytes_per_block
    assert half.num_blocks == 2 * full.num_blocks and half.kv_block_layout().dtype == torch.bfloat16
    engine = start_engine(DecoderConfig(model_dir=path, max_model_len=256, num_blocks=40, kv_cache_dtype="bfloat16"))
    try:
        cache = engine.parts.cache
        assert {t.dtype for t in cache.key + cache.value} == {torch.bfloat16}
        assert next(engine.parts.model.parameters()).dtype == torch.float32
    finally:
        engine.shutdown()
    assert LLMEngine(half).collector().cache.cache_dtype == "bfloat16"  # vllm:cache_config_info's label
    assert LLMEngine(full).collector().cache.cache_dtype == "float32"


@pytest.mark.parametrize("options, message", [
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be one of \\('auto', 'bfloat16'\\), got 'fp8'"),
    (dict(kv_cache_dtype="float16"), "kv_cache_dtype must be one of"),
    (dict(kv_cache_dtype="bfloat16", dtype="float16"), "--kv-cache-dtype bfloat16 does not fit dtype 'float16'"),
    (dict(kv_cache_dtype="bfloat16", dtype="float64"), "--kv-cache-dtype bfloat16 does not fit dtype 'float64'"),
])
def test_refused_naming_the_flag(model, options, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig(model_dir=str(model[0]), **options)


def test_a_bfloat16_model_takes_it_as_its_own_dtype(model):
    config = DecoderConfig(model_dir=str(model[0]), dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert config.kv_cache_torch_dtype == torch.bfloat16
    assert DecoderConfig(model_dir=str(model[0]), dtype="float32").kv_cache_torch_dtype == torch.float32
