"""The attention backend registry: config validates names against it without building anything, and
every registered backend, through its own metadata built from a scheduled batch, equals a float64
reference, plain and with sliding windows and soft caps (the reference applies them, so a backend
ignoring one fails; slots before a window hold NaN keys) (triton in the interpreter subprocess of test_triton_attention.py, which runs
attention_kernel_cases.backend_case("triton"))."""

import pytest
import torch
from attention_kernel_cases import BACKEND_OPTIONS, backend_case

from services.decoder.attention import ATTENTION_BACKENDS, make_attention_backend
from services.decoder.config import DecoderConfig
from services.decoder.kernels import native

IN_PROCESS = [name for name in ATTENTION_BACKENDS if name != "triton"]  # Triton needs TRITON_INTERPRET at import


def test_unknown_backend_is_refused_naming_the_registered_ones(tiny_llama):
    for build in (lambda: DecoderConfig(model_dir=str(tiny_llama), attention_backend="flash"),
                  lambda: make_attention_backend("flash")):
        with pytest.raises(ValueError, match="attention_backend must be one of") as info:
            build()
        assert all(repr(name) in str(info.value) for name in ATTENTION_BACKENDS) and "'flash'" in str(info.value)


def test_config_builds_no_kernel(tiny_llama, monkeypatch):
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert DecoderConfig(model_dir=str(tiny_llama), attention_backend="cpu").attention_backend == "cpu"
    assert not native.is_loaded()  # built by the backend when the engine starts (test_cpu_attention.py)


@pytest.mark.parametrize("options", BACKEND_OPTIONS, ids=str)
@pytest.mark.parametrize("name", IN_PROCESS)
def test_backend_equals_float64_reference_on_a_paged_batch(name, options):
    assert backend_case(name, **options) < 1e-5


@pytest.mark.parametrize("options", BACKEND_OPTIONS[1:], ids=str)
@pytest.mark.parametrize("name", IN_PROCESS)
def test_window_and_cap_in_bfloat16(name, options):
    assert backend_case(name, dtype=torch.bfloat16, **options) < 2e-2


@pytest.mark.parametrize("options", BACKEND_OPTIONS, ids=str)
@pytest.mark.parametrize("name", IN_PROCESS)
def test_float32_queries_over_a_bfloat16_cache(name, options):
    """--kv-cache-dtype bfloat16 on a float32 model: K/V rounded as written, read back widened exactly,
    so the backend equals the float64 reference over the cache's values to float32 rounding."""
    assert backend_case(name, cache_dtype=torch.bfloat16, **options) < 1e-5


@pytest.mark.parametrize("name", IN_PROCESS)
@pytest.mark.parametrize("options", [{"sliding_window": 0}, {"logits_soft_cap": 0.0}, {"logits_soft_cap": -1.0}],
                         ids=str)
def test_bad_window_or_cap_is_refused(name, options):
    with pytest.raises(ValueError, match="sliding_window must be >= 1|logits_soft_cap must be > 0"):
        backend_case(name, **options)


def test_split_batch_slots_equal_cache_slots_row_by_row():
    """The slot mapping split_batch builds (decode rows' slots without tensors, gathered between
    prefill spans) is cache_slots' row for row; a decode position past its table is refused; padded
    block tables hold each table then block 0."""
    from types import SimpleNamespace

    from services.decoder.attention.backend import cache_slots
    from services.decoder.attention.torch_backend import split_batch
    from services.decoder.block_manager import padded_block_tables
    from services.decoder.scheduler import ScheduledRequest

    def item(start, num_new_tokens):
        return ScheduledRequest(SimpleNamespace(num_computed_tokens=start, num_tokens=start + num_new_tokens),
                                num_new_tokens)

    tables = [[7, 3, 9], [2, 5], [4], [8, 1, 6, 0], [11, 12]]
    for batch in ([item(9, 1), item(2, 5), item(0, 1), item(13, 1), item(0, 6)],  # decode, prefill, decode x2, prefill
                  [item(9, 1), item(6, 1), item(3, 1)]):
        split = split_batch(batch, tables[:len(batch)], 4)
        want = torch.cat([cache_slots(t, it.start, it.end, 4) for it, t in zip(batch, tables)])
        assert split.slot_mapping.dtype == torch.long and torch.equal(split.slot_mapping, want)
        rows = [sum(it.num_new_tokens for it in batch[:i]) for i, it in enumerate(batch) if it.num_new_tokens == 1]
        assert split.decode_rows == rows
    assert split.slot_mapping.tolist() == [9 * 4 + 1, 5 * 4 + 2, 4 * 4 + 3]
    with pytest.raises(ValueError, match="a block table of 2 blocks of 4 does not cover positions up to 9"):
        split_batch([item(8, 1)], [[2, 5]], 4)
    padded = padded_block_tables([[7, 3, 9], [2], [4, 6]])
    assert padded.dtype == torch.int32 and padded.tolist() == [[7, 3, 9], [2, 0, 0], [4, 6, 0]]
