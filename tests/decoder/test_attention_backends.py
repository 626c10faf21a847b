"""The attention backend registry: config validates names against it without building anything, and
every registered backend, through its own metadata built from a scheduled batch, equals a float64
reference (triton in the interpreter subprocess of test_triton_attention.py, which runs
attention_kernel_cases.backend_case("triton"))."""

import pytest
from attention_kernel_cases import backend_case

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


@pytest.mark.parametrize("name", IN_PROCESS)
def test_backend_equals_float64_reference_on_a_paged_batch(name):
    assert backend_case(name) < 1e-5
