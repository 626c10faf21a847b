"""The LoRA runtime's seams: the backend interface loads no implementation, config takes its
choices from the backend registry and builds no kernel, and a step's LoRA compute takes no lock
of AdapterSlots (a load or lease on another thread never stalls a forward pass)."""

import json
import os
import subprocess
import sys
import threading
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from services.decoder.config import DecoderConfig
from services.decoder.kernels import native
from services.decoder.lora import AdapterSlots, LoRAContext, LoRAWeights
from services.decoder.lora.registry import LORA_BACKENDS, make_backend

ROOT = Path(__file__).resolve().parents[2]
IMPLEMENTATIONS = {"services.decoder.lora.torch_backend", "services.decoder.lora.cpu_backend",
                   "services.decoder.lora.triton_backend", "services.decoder.kernels.native", "triton"}


def test_interface_and_registry_import_no_implementation():
    code = ("import json, sys; import services.decoder.lora.backend, services.decoder.lora.registry; "
            "print(json.dumps(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout))
    assert {"services.decoder.lora.backend", "services.decoder.lora.registry"} <= loaded
    assert not loaded & IMPLEMENTATIONS


def test_config_refuses_an_unknown_lora_backend_naming_the_registered_ones(tiny_llama):
    with pytest.raises(ValueError) as refusal:
        DecoderConfig(model_dir=str(tiny_llama), lora_backend="cuda")
    message = str(refusal.value)
    assert "'cuda'" in message and all(repr(name) in message for name in LORA_BACKENDS)
    lora_backend = next(f for f in fields(DecoderConfig) if f.name == "lora_backend")
    assert lora_backend.metadata["choices"] == ("auto", *LORA_BACKENDS) == ("auto", "torch", "triton", "cpu")


def test_the_cpu_kernel_is_built_by_its_backend_not_by_config(tiny_llama, monkeypatch):
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert DecoderConfig(model_dir=str(tiny_llama), lora_backend="cpu").lora_backend == "cpu"
    assert not native.is_loaded()
    with pytest.raises(ValueError, match="lora_backend 'cpu' cannot run here: .*need a C compiler"):
        make_backend("cpu")


def test_a_step_computes_while_another_thread_holds_the_slots_lock():
    slots = AdapterSlots(num_slots=2, max_rank=2, module_shapes={"m.q": (3, 4)})
    a, b = torch.arange(6.0).view(2, 3), torch.arange(8.0).view(4, 2)
    slot = slots.load_and_acquire(LoRAWeights("a", {"m.q": (a, b)}))
    context = LoRAContext(slots, make_backend("torch"))
    x, y = torch.ones(2, 3), torch.zeros(2, 4)
    held, done = threading.Event(), threading.Event()

    def hold():
        with slots.lock:
            held.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    results = []
    stepper = threading.Thread(target=lambda: results.append(_step(context, slot, x, y)))
    stepper.start()
    stepper.join(30)
    finished_while_held = not stepper.is_alive()
    done.set()
    holder.join(30)
    stepper.join(30)
    assert finished_while_held and results == [True]
    assert torch.equal(y[0], (x[0] @ a.T) @ b.T)    # the adapter row got its correction
    assert torch.equal(y[1], torch.zeros(4))        # the base row is untouched
    assert not context.active


def _step(context: LoRAContext, slot: int, x: torch.Tensor, y: torch.Tensor) -> bool:
    with context.step(torch.tensor([slot, -1]), torch.tensor([0, 1])):
        assert context.active
        context.apply("m.q", x, y)
    return True
