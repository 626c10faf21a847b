"""The GGUF dequantize-in-the-GEMM kernels (services/decoder/kernels/quant_triton.py) against gguf-py.

The weights are gguf-py's bytes: `gguf.quants.quantize` of random rows for Q8_0/Q4_0/Q4_1, random blocks
with small finite f16 d/dmin for the K-quants (every byte pattern is a valid block); the reference is
`gguf.quants.dequantize` of the same bytes and a float64 matmul. Each output element must lie within
tol * sum_i |x_i| |w_i| of it (1e-4 for float32 x; one weight rounding for float16/bfloat16). Sizes are
odd on purpose: m in {1, 3, 17, 33} around the 16-row tile, n = 37 around the 32-row tile, k a multiple
of the block and not (80 = 2.5 Q8_0 blocks, 300 = 1.17 K-quant blocks).

Triton reads TRITON_INTERPRET when the kernels are defined, so without CUDA the kernel cases run in a
subprocess (this file as a script) under the interpreter; with a CUDA device (TESSERA_DECODER_DEVICE=cuda,
as bench/gpu_check.sh sets, or torch seeing one, and TRITON_INTERPRET unset) they run in this process on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from services.decoder.kernels.quant_triton import QUANT_FORMATS, dequantize_rows, quantized_matmul

ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = ("cuda" if not INTERPRETED and (os.environ.get("TESSERA_DECODER_DEVICE") == "cuda"
                                          or torch.cuda.is_available()) else "cpu")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
N = 37
# (qtype, m, k, x dtype, bias)
CASES = [("Q8_0", 1, 80, torch.float32, True), ("Q8_0", 33, 64, torch.float32, False),
         ("Q4_0", 3, 80, torch.float32, True), ("Q4_0", 17, 64, torch.float16, False),
         ("Q4_1", 17, 80, torch.float32, True), ("Q4_1", 3, 80, torch.bfloat16, True),
         ("Q4_K", 3, 300, torch.float32, True), ("Q4_K", 17, 256, torch.bfloat16, False),
         ("Q6_K", 1, 300, torch.float32, False), ("Q6_K", 33, 300, torch.float32, True)]


def make_weights(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes]: n rows of k weights in gguf-py's bytes (module docstring)."""
    fmt = QUANT_FORMATS[qtype]
    num_blocks = -(-k // fmt.block_size)
    kind = gguf.GGMLQuantizationType[qtype]
    if fmt.block_size == 32:
        w = np.zeros((n, num_blocks * 32), np.float32)
        w[:, :k] = rng.standard_normal((n, k))
        return gguf.quants.quantize(w, kind)
    blocks = rng.integers(0, 256, (n, num_blocks, fmt.block_bytes), dtype=np.uint8)
    for offset in ((0, 2) if qtype == "Q4_K" else (208,)):  # d, dmin | d
        blocks[..., offset:offset + 2] = rng.uniform(-0.05, 0.05, (n, num_blocks, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def reference_weights(raw: np.ndarray, qtype: str, k: int) -> np.ndarray:
    """float64 [n, k]: gguf-py's dequantization of the bytes."""
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])[:, :k].astype(np.float64)


def run_case(index: int, device: str) -> dict:
    """Case `index` of CASES on device: the kernel's error against the float64 reference, as a fraction
    of sum |x||w|; and whether one-hot rows of x return dequantized weights exactly (float32; a 128-wide
    k tile, across 32-blocks and inside 256-blocks)."""
    qtype, m, k, dtype, with_bias = CASES[index]
    rng = np.random.default_rng(index)
    raw = make_weights(qtype, N, k, rng)
    w = reference_weights(raw, qtype, k)                                         # [n, k]
    x = torch.from_numpy(rng.standard_normal((m, k))).to(dtype)                 # [m, k]
    bias = torch.from_numpy(rng.standard_normal(N)).float() if with_bias else None
    if index == 0:  # rows in a wider buffer: data.stride(0) > row_bytes
        wide = np.zeros((N, raw.shape[1] + 7), np.uint8)
        wide[:, :raw.shape[1]] = raw
        data = torch.from_numpy(wide).to(device)[:, :raw.shape[1]]
    else:
        data = torch.from_numpy(np.ascontiguousarray(raw)).to(device)
    out = quantized_matmul(x.to(device), data, qtype, k, None if bias is None else bias.to(device))
    x64 = x.double().numpy()
    ref = x64 @ w.T + (0 if bias is None else bias.double().numpy())
    scale = np.abs(x64) @ np.abs(w).T + (0 if bias is None else np.abs(bias.double().numpy()))
    err = np.abs(out.cpu().double().numpy() - ref) / np.maximum(scale, 1e-30)
    picks = np.linspace(0, k - 1, 17).round().astype(np.int64)                   # across blocks, and k - 1
    onehot = torch.zeros(17, k)
    onehot[torch.arange(17), torch.from_numpy(picks)] = 1.0
    picked = quantized_matmul(onehot.to(device), data, qtype, k, block_n=64, block_k=128)  # other tiles
    picked = picked.cpu().double().numpy()
    return {"case": index, "qtype": qtype, "dtype": str(dtype), "shape": list(out.shape),
            "out_dtype": str(out.dtype), "err": float(err.max()), "tol": TOL[dtype],
            "onehot_exact": bool(np.array_equal(picked, w[:, picks].T))}


@pytest.fixture(scope="module")
def kernel_results() -> list[dict]:
    if DEVICE == "cuda":
        return [run_case(i, "cuda") for i in range(len(CASES))]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.parametrize("qtype", sorted(QUANT_FORMATS))
def test_quantized_matmul_equals_gguf_dequantize_float64(kernel_results, qtype):
    results = [r for r in kernel_results if r["qtype"] == qtype]
    assert len(results) == sum(case[0] == qtype for case in CASES)
    for r in results:
        qtype_, m, _, dtype, _ = CASES[r["case"]]
        assert r["shape"] == [m, N] and r["out_dtype"] == str(dtype), r
        assert r["err"] < r["tol"], r
        assert r["onehot_exact"], r


def test_formats_are_ggml_block_sizes():
    for name, fmt in QUANT_FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (fmt.block_size, fmt.block_bytes)
    assert QUANT_FORMATS["Q4_K"].row_bytes(300) == 288 and QUANT_FORMATS["Q8_0"].row_bytes(64) == 68


@pytest.mark.parametrize("qtype", sorted(QUANT_FORMATS))
def test_dequantize_rows_equals_gguf(qtype):
    k = 300 if QUANT_FORMATS[qtype].block_size == 256 else 80
    raw = make_weights(qtype, 9, k, np.random.default_rng(5))
    ids = torch.tensor([8, 0, 3, 3, 7])
    got = dequantize_rows(torch.from_numpy(raw), qtype, k, ids)
    assert got.dtype == torch.float32 and got.shape == (5, k)
    assert np.array_equal(got.numpy(), reference_weights(raw, qtype, k)[ids.numpy()].astype(np.float32))
    assert dequantize_rows(torch.from_numpy(raw), qtype, k, ids[:0]).shape == (0, k)


def test_bad_inputs_are_refused():
    data = torch.zeros(4, 102, dtype=torch.uint8)  # Q8_0 rows of k = 80
    x = torch.zeros(2, 80)
    for call, message in ((lambda: quantized_matmul(x, data, "Q5_K", 80), "qtype must be one of"),
                          (lambda: quantized_matmul(x, data, "Q8_0", 128), "data must be uint8"),
                          (lambda: quantized_matmul(x, data.to(torch.int8), "Q8_0", 80), "data must be uint8"),
                          (lambda: quantized_matmul(x[:, :79], data, "Q8_0", 80), "x must be"),
                          (lambda: quantized_matmul(x.double(), data, "Q8_0", 80), "x must be"),
                          (lambda: quantized_matmul(x, data, "Q8_0", 80, torch.zeros(5)), "bias must be"),
                          (lambda: quantized_matmul(x, data, "Q8_0", 0), "k must be positive"),
                          (lambda: quantized_matmul(x, data, "Q8_0", 80, block_k=48), "block_k must be a power"),
                          (lambda: dequantize_rows(data, "Q8_0", 80, torch.zeros(2, 1, dtype=torch.long)), "ids must"),
                          (lambda: dequantize_rows(data, "q8_0", 80, torch.zeros(2, dtype=torch.long)), "qtype")):
        with pytest.raises(ValueError, match=message):
            call()


if __name__ == "__main__":
    if not INTERPRETED and not torch.cuda.is_available():
        sys.exit("run with TRITON_INTERPRET=1 or on a CUDA device")
    for i in range(len(CASES)):
        print(json.dumps(run_case(i, DEVICE)))
