"""The decoder backs what a decode step streams with huge pages (services/common/memory.py
`back_with_huge_pages`): every weight (row-major, or the cpu linear backend's packed panels) once
the parts are built, and the LoRA slots' factors when a load first allocates them; the KV cache
is left in 4 KiB pages."""

from __future__ import annotations

import pytest
import torch
from decoder_testing import tiny_llama  # noqa: F401  (fixture)

import services.decoder.engine_parts as engine_parts
import services.decoder.lora.slots as slots_module
from services.common.memory import THP_ENABLED
from services.decoder.config import DecoderConfig
from services.decoder.engine_parts import build_parts
from services.decoder.kv_cache import KVCache
from services.decoder.lora.slots import LoRAWeights


@pytest.mark.parametrize(("dtype", "linear_backend"), [("float32", "cpu"), ("bfloat16", "torch")])
def test_every_weight_and_the_slots_are_handed_to_huge_pages(tiny_llama, monkeypatch, dtype, linear_backend):  # noqa: F811
    weights, slots = [], []
    monkeypatch.setattr(engine_parts, "back_with_huge_pages", lambda tensors: weights.extend(tensors) or 0)
    monkeypatch.setattr(slots_module, "back_with_huge_pages", lambda tensors: slots.extend(tensors) or 0)
    parts = build_parts(DecoderConfig(model_dir=str(tiny_llama), dtype=dtype, linear_backend=linear_backend,
                                      num_blocks=16, adapter_slots=2, max_lora_rank=8))
    handed = {t.data_ptr() for t in weights}
    assert all(p.data_ptr() in handed for p in parts.model.parameters())
    panels = [m.gemm.panels for m in parts.model.modules() if getattr(m, "gemm", None) is not None]
    assert bool(panels) == (linear_backend == "cpu") and all(p.data_ptr() in handed for p in panels)
    assert not handed & {t.data_ptr() for t in parts.cache.key + parts.cache.value}
    first, second = list(parts.bank.module_shapes)[:2]  # the warm-up's adapter targets the first module
    a, b = parts.bank.factors(first)
    assert {a.data_ptr(), b.data_ptr()} <= {t.data_ptr() for t in slots}
    assert parts.bank.factors(second) is None

    slots.clear()
    in_features, out_features = parts.bank.module_shapes[second]
    parts.bank.load(LoRAWeights("digest", {second: (torch.randn(4, in_features), torch.randn(out_features, 4))}))
    a, b = parts.bank.factors(second)
    assert {a.data_ptr(), b.data_ptr()} <= {t.data_ptr() for t in slots}
    slots.clear()
    parts.bank.load(LoRAWeights("other", {second: (torch.randn(4, in_features), torch.randn(out_features, 4))}))
    assert not slots  # its buffers exist: nothing new to back


def test_the_kv_cache_is_one_zeroed_allocation_in_huge_pages():
    from tests.common.test_memory import _kb

    cache = KVCache(2, 1024, 16, 2, 64, torch.float32)  # 4 pools of 8 MiB
    pools = cache.key + cache.value
    assert all(p.shape == (2, 1024 * 16, 64) and p.is_contiguous() and not p.any() for p in pools)
    assert len({p.untyped_storage().data_ptr() for p in pools}) == 1
    low = min(p.data_ptr() for p in pools)
    high = max(p.data_ptr() + p.nbytes for p in pools)
    assert high - low == 32 * 1024 * 1024
    huge = _kb(low, high, "AnonHugePages:")
    assert huge >= 24 * 1024 or "[never]" in THP_ENABLED.read_text()
