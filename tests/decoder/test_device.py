"""`--device auto|cpu|cuda[:N]`: resolution and refusals, the pairing with the backends, and the
plumbing that puts weights, KV cache, adapter slots, rotary tables, generators and each step's
inputs on the configured device (checked as torch.device objects; the step inputs on "meta", a
device that is not the CPU on every machine)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.device import resolve_device
from services.decoder.block_manager import BlockManager
from services.decoder.config import DecoderConfig
from services.decoder.engine import start_engine
from services.decoder.kv_cache import KVCache
from services.decoder.lora import LoRAWeights
from services.decoder.model_runner import ModelRunner
from services.decoder.models import load_model
from services.decoder.request import Request
from services.decoder.sampler import make_generator
from services.decoder.scheduler import Scheduler
from services.decoder.types import GenerateInput, PromptInputs, SamplingParams
from tessera.paths import default_decoder_dir

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def test_resolve_device_reads_each_spelling_and_refuses_naming_the_flag():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert resolve_device("auto") == (torch.device("cuda", 0) if count else CPU)
    assert resolve_device("cpu") == resolve_device(" CPU ") == CPU
    for bad in ("gpu", "cpu:0", "cuda:x", "cuda:-1", ""):
        with pytest.raises(ValueError, match="--device .* is not a device; expected auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    with pytest.raises(ValueError, match=f"--device cuda:{count}"):  # one past the last device, on any machine
        resolve_device(f"cuda:{count}")
    if not count:
        with pytest.raises(ValueError, match="--device cuda needs a CUDA device; torch sees none"):
            resolve_device("cuda")


def test_config_resolves_the_device_once_and_refuses_backends_that_cannot_run_there(tiny_llama, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = DecoderConfig(model_dir=str(tiny_llama), device="cpu")
    assert config.torch_device == CPU and isinstance(config.torch_device, torch.device)
    assert DecoderConfig(model_dir=str(tiny_llama), attention_backend="cpu").torch_device == CPU  # auto: the CPU
    for flag, field in (("--attention-backend", "attention_backend"), ("--lora-backend", "lora_backend")):
        with pytest.raises(ValueError, match=f"{flag} triton needs a CUDA device or TRITON_INTERPRET=1"):
            DecoderConfig(model_dir=str(tiny_llama), device="cpu", **{field: "triton"})
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's CPU interpreter runs the kernels on CPU tensors
    assert DecoderConfig(model_dir=str(tiny_llama), device="cpu", attention_backend="triton",
                         lora_backend="triton").torch_device == CPU
    monkeypatch.setenv("TESSERA_DECODER_DEVICE", "cpu")  # the flag's environment variable
    from services.decoder.__main__ import parse_args
    assert parse_args(["--model-dir", str(tiny_llama)]).device == "cpu"


def _tensors(value):
    """Every tensor inside `value` (dataclass fields, lists, tuples), nested."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name))


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_engine_puts_weights_cache_slots_tables_and_generators_on_its_device(tiny_llama, device):
    engine = start_engine(DecoderConfig(model_dir=str(tiny_llama), device=device, num_blocks=16, max_model_len=128))
    try:
        device = engine.device
        assert device == resolve_device(engine.config.device) == engine.config.torch_device
        assert device.type == engine.config.device
        placed = [*engine.parts.model.parameters(), *engine.parts.model.buffers(), engine.parts.model.rotary.inv_freq,
                  *engine.parts.cache.key, *engine.parts.cache.value]
        name, (in_features, out_features) = next(iter(engine.parts.bank.module_shapes.items()))
        engine.parts.bank.load(LoRAWeights("d", {name: (torch.ones(2, in_features), torch.ones(out_features, 2))}))
        placed += [factor for module in engine.parts.bank.module_shapes if (f := engine.parts.bank.factors(module)) for factor in f]
        assert len(placed) > 20 and {t.device for t in placed} == {device}
        assert engine.parts.cache.device == engine.parts.bank.device == device
        request = engine._make_requests(_generate_input(seed=5), PromptInputs([1, 2, 3]), None, "")[0]
        assert request.generator.device == device == make_generator(None, device).device
    finally:
        engine.shutdown()


def _generate_input(seed: int) -> GenerateInput:
    return GenerateInput(SamplingParams(max_tokens=2, temperature=1.0, seed=seed), prompt_token_ids=(1, 2, 3))


def test_each_step_input_is_built_on_the_cache_device(tiny_llama):
    """The model runner moves ids, positions, slots, sample rows and the attention backend's metadata
    (nested spans and groups) to the cache's device once per step; "meta" stands in for a GPU."""
    model = load_model(tiny_llama, torch.float32)
    spec = model.spec
    cache = KVCache(spec.num_layers, 8, 4, spec.num_kv_heads, spec.head_dim, torch.float32, "meta")
    block_manager = BlockManager(8, 4)
    scheduler = Scheduler(block_manager, 4, 64, 8)
    runner = ModelRunner(model, cache, block_manager, None, mrope=False)
    prefill = Request("p", "p", PromptInputs(list(range(1, 8))), SamplingParams(max_tokens=1))
    decode = Request("d", "d", PromptInputs([1, 2, 3]), SamplingParams(max_tokens=4))
    scheduler.add(decode)
    scheduler.update(scheduler.schedule())
    decode.output_token_ids.append(9)  # now one token to compute: a decode row beside the prefill
    scheduler.add(prefill)
    inputs = runner.prepare(scheduler.schedule())
    tensors = list(_tensors(dataclasses.replace(inputs, sampled=[])))
    assert inputs.meta.prefills and inputs.meta.decode_groups  # both kinds of metadata were built
    assert len(tensors) >= 8 and {t.device for t in tensors} == {torch.device("meta")}


def test_decoder_refuses_a_configuration_this_machine_cannot_run_in_one_line():
    """No CUDA device (hidden from torch) and no Triton interpreter: each process exits non-zero at
    start with one line on stderr naming the flag, before loading anything (run side by side)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    cases = {"--device cuda": ["--device", "cuda"], "--attention-backend triton": ["--attention-backend", "triton"]}
    procs = {named: subprocess.Popen([sys.executable, "-m", "services.decoder", "--model-dir", str(default_decoder_dir()),
                                      "--address", "127.0.0.1:0", *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True) for named, flags in cases.items()}
    for named, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        lines = stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1, stderr
        assert lines[0].startswith(f"python -m services.decoder: error: {named} needs a CUDA device"), lines
