"""Mixed batch: base rows + adapters of ranks 4/8/16 (plain, rsLoRA, rank_pattern/alpha_pattern)
in one engine batch; each request's greedy ids equal PeftModel with that adapter alone and its
logits are within 1e-4, with the torch backend, the cpu backend (C BGMV kernel for decode rows) and
the Triton BGMV/SGMV kernels (CPU interpreter, in a subprocess because Triton reads TRITON_INTERPRET
when kernels are defined)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lora_mixed_cases import ADAPTERS, PROMPTS, compare, save_adapters

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def adapter_root(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    save_adapters(tiny_llama, root)
    return root


def _check(report):
    assert len(report) == (1 + len(ADAPTERS)) * len(PROMPTS)
    for key, r in report.items():
        assert r["ids_equal"], (key, r)
        assert r["max_logit_err"] < 1e-4, (key, r)
    for name in ADAPTERS:  # every adapter changes the greedy continuation of some prompt
        assert any(report[f"{name}-{i}"]["differs_from_base"] for i in range(len(PROMPTS))), name


def test_mixed_batch_torch_backend_equals_peft(tiny_llama, adapter_root):
    _check(compare(tiny_llama, adapter_root, "torch"))


def test_mixed_batch_cpu_backend_equals_peft(tiny_llama, adapter_root):
    """The C BGMV kernel for decode rows (lora_backend="cpu"), the torch backend for prefill rows."""
    _check(compare(tiny_llama, adapter_root, "cpu"))


def test_mixed_batch_triton_backend_equals_peft(tiny_llama, adapter_root):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    script = Path(__file__).with_name("lora_mixed_cases.py")
    proc = subprocess.run([sys.executable, str(script), str(tiny_llama), str(adapter_root), "triton"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads(proc.stdout.strip().splitlines()[-1]))
