"""dtype "auto" follows the checkpoint (half precision on a CPU: bfloat16 with native bf16, else float32), and
attention_backend / lora_backend "auto" resolve to the fastest backend that runs: triton on CUDA,
the C kernels on the CPU where they build and compute the dtype, torch otherwise."""

import json
import logging
import shutil

import pytest
import torch

from services.decoder.attention import resolve_attention_backend
from services.decoder.config import DecoderConfig, checkpoint_dtype, resolve_dtype
from services.decoder.engine_parts import resolve_backends
from services.decoder.kernels import native
from services.decoder.lora.registry import resolve_lora_backend, triton_available

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("raw, device, expected", [
    ({"torch_dtype": "bfloat16"}, CUDA, "bfloat16"),
    ({"dtype": "float32"}, CPU, "float32"),               # transformers 5 writes "dtype"
    ({"torch_dtype": "torch.float16"}, CUDA, "float16"),
    ({"text_config": {"torch_dtype": "bfloat16"}}, CUDA, "bfloat16"),  # a vision-language checkpoint
    ({}, CPU, "float32"),                                 # none declared: transformers' default
    ({"torch_dtype": "float8_e4m3fn"}, CPU, "float32"),   # one tessera does not load
])
def test_dtype_auto_follows_the_checkpoint(raw, device, expected):
    assert resolve_dtype(raw, device) == expected


@pytest.mark.parametrize("declared", ["float16", "bfloat16"])
def test_half_precision_on_a_cpu_serves_as_bfloat16_only_with_native_bf16(monkeypatch, declared):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert resolve_dtype({"torch_dtype": declared}, CPU) == "bfloat16"
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert resolve_dtype({"torch_dtype": declared}, CPU) == "bfloat16"
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2"}))  # emulated bf16 is slower
    assert resolve_dtype({"torch_dtype": declared}, CPU) == "float32"


def test_config_resolves_auto_from_a_bf16_checkpoint(tiny_llama, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512_bf16"}))  # as if computed natively
    model_dir = tmp_path / "bf16"
    shutil.copytree(tiny_llama, model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("dtype", None)
    (model_dir / "config.json").write_text(json.dumps({**raw, "torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(json.loads((tiny_llama / "config.json").read_text())) == "float32"
    with caplog.at_level(logging.INFO):
        config = DecoderConfig(model_dir=str(model_dir))
        assert (config.attention_backend, config.lora_backend, config.linear_backend) == ("auto",) * 3  # built at start
        chosen = [r.getMessage() for r in caplog.records if "auto:" in r.getMessage()]
        assert len(chosen) == 1 and "bfloat16" in chosen[0]  # the dtype
        backends = resolve_backends(config)
    assert config.dtype == "bfloat16"
    built = native.unavailable("bfloat16") is None
    assert (backends.attention, backends.lora) == (("cpu", "cpu") if built else ("torch", "torch"))
    chosen = [r.getMessage() for r in caplog.records if "auto:" in r.getMessage()]
    assert len(chosen) == 4 and any("bfloat16" in line for line in chosen)  # dtype + 3 backends, once each
    explicit = DecoderConfig(model_dir=str(model_dir), dtype="float32", attention_backend="torch")
    assert (explicit.dtype, resolve_backends(explicit).attention) == ("float32", "torch")


def test_backend_auto_per_device_and_dtype():
    built = native.unavailable("float32") is None
    assert resolve_attention_backend("auto", CPU, "float32", 16) == ("cpu" if built else "torch")
    assert resolve_attention_backend("auto", CPU, "float16", 16) == "torch"  # the kernels do not compute it
    assert resolve_lora_backend("auto", CPU, "float64") == "torch"
    assert resolve_attention_backend("auto", CUDA, "bfloat16", 16) == "triton"
    assert resolve_attention_backend("auto", CUDA, "bfloat16", 12) == "torch"  # triton needs a power of two
    assert resolve_lora_backend("auto", CUDA, "bfloat16") == ("triton" if triton_available() is None else "torch")
    assert resolve_attention_backend("auto", torch.device("meta"), "float32", 16) == "torch"
    for name in ("torch", "cpu", "triton"):  # a named backend is taken as named
        assert resolve_attention_backend(name, CUDA, "float16", 12) == name
        assert resolve_lora_backend(name, CPU, "float64") == name


def test_the_config_builds_no_kernels(tiny_llama, monkeypatch):
    """Backend choice, and the C kernel builds it may need, happen when the engine starts."""
    def refuse():
        raise AssertionError("DecoderConfig built the C kernels")

    monkeypatch.setattr(native, "load", refuse)
    config = DecoderConfig(model_dir=str(tiny_llama))
    assert (config.attention_backend, config.lora_backend, config.linear_backend) == ("auto",) * 3
