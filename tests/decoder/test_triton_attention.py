"""The Triton paged attention kernel equals the torch path (Triton's CPU interpreter, in a subprocess
because Triton reads TRITON_INTERPRET when kernels are defined): kernel-level on scattered blocks with
GQA / MHA / non-power-of-two head_dim, the backend on a paged batch with sliding windows and soft caps
(over a float32 cache and a bfloat16 one), and the whole engine (Llama; Mistral, its blocks before the window released) with attention_backend="triton"."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from attention_kernel_cases import BACKEND_OPTIONS
from decoder_testing import make_tiny_llama

from services.decoder.config import DecoderConfig

ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernel_and_engine_match_torch_in_the_interpreter(tiny_llama, tmp_path):
    # a Mistral whose window of 8 the 20-token prompt crosses: blocks are released mid-request
    mistral = make_tiny_llama(tmp_path / "mistral", family="mistral", sliding_window=8)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    script = Path(__file__).with_name("attention_kernel_cases.py")
    done = subprocess.run([sys.executable, str(script), str(tiny_llama), str(mistral)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("OK kernel") for line in lines) == 3
    assert sum(line.startswith("OK engine") for line in lines) == 2  # Llama, Mistral
    # the backend case plain and with each sliding window / soft cap of BACKEND_OPTIONS, over a float32
    # cache and a bfloat16 one (--kv-cache-dtype bfloat16: float32 queries, the cache widened as read)
    assert sum(line.startswith("OK backend triton") for line in lines) == 2 * len(BACKEND_OPTIONS)
    assert sum(line.startswith("OK backend triton") and "bfloat16" in line for line in lines) == len(BACKEND_OPTIONS)


def test_backend_flag_is_validated(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        DecoderConfig(model_dir=str(tiny_llama), attention_backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton needs a CUDA device or TRITON_INTERPRET=1"):
        DecoderConfig(model_dir=str(tiny_llama), attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="power-of-two block_size"):
        DecoderConfig(model_dir=str(tiny_llama), attention_backend="triton", block_size=12)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert DecoderConfig(model_dir=str(tiny_llama)).attention_backend != "triton"  # auto on the CPU
