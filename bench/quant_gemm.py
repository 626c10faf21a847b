"""The quantized GEMM (kernels/quant_gemm.c, services/decoder/quant.py) beside torch's float32
`F.linear` on one decode step's projections of SmolLM2-135M.

Shapes: hidden 576, intermediate 1536, 30 layers of q 576x576, k / v 192x576, o 576x576, gate / up
1536x576, down 576x1536, then the lm_head 49152x576; one distinct weight per projection, so the
weights stream from memory as in a real step. For each row count M, every format in exact and fast
mode and torch float32 (the same shapes, dequantized-size weights) run interleaved for `--rounds`
rounds; the table gives the median time per step and GB/s of weight bytes read (quantized bytes for
the C kernel, float32 bytes for torch). Prints the host's CPU flags first. Never a test assertion.

    .venv/bin/python bench/quant_gemm.py [--rounds 9] [--threads 2] [--rows 1 4 16 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import torch.nn.functional as F

from services.decoder.kernels import native
from services.decoder.quant import GGUF_QTYPES, QUANT_MODES, QuantizedWeight, quantized_variant, row_bytes

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152
F16_FIELDS = {"Q8_0": (0, 2), "Q4_0": (0, 2), "Q4_1": (0, 4), "Q4_K": (0, 4), "Q6_K": (208, 210)}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}


def shapes() -> list[tuple[int, int]]:
    """(out, in) of every projection of one step, in order."""
    layer = [(HIDDEN, HIDDEN), (192, HIDDEN), (192, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN),
             (HIDDEN, INTER)]
    return layer * LAYERS + [(VOCAB, HIDDEN)]


def random_blocks(qtype: str, out_features: int, in_features: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [out, row_bytes]: random bytes with small finite f16 scales (speed does not depend on values)."""
    nbytes = BLOCK_BYTES[qtype]
    data = rng.integers(0, 256, (out_features, row_bytes(qtype, in_features) // nbytes, nbytes), dtype=np.uint8)
    start, stop = F16_FIELDS[qtype]
    data[..., start:stop] = (rng.standard_normal(data.shape[:2] + ((stop - start) // 2,)) * 0.01).astype(
        np.float16).view(np.uint8)
    return torch.from_numpy(data.reshape(out_features, -1))


def step(ways: dict, name: str, xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for fn, in_features in ways[name]:
        fn(xs[in_features])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu: {native.cpu_model()}; flags: {' '.join(sorted(native.cpu_flags()))}")
    print(f"quant_gemm variant: {quantized_variant()}; threads {args.threads}; rounds {args.rounds} (medians)")
    rng = np.random.default_rng(0)
    ways, nbytes = {}, {}
    dense = [torch.randn(o, i) * i ** -0.5 for o, i in shapes()]
    ways["torch fp32"] = [((lambda x, w=w: F.linear(x, w)), w.shape[1]) for w in dense]
    nbytes["torch fp32"] = sum(w.numel() * 4 for w in dense)
    for qtype in GGUF_QTYPES:
        data = [random_blocks(qtype, o, i, rng) for o, i in shapes()]
        for mode in QUANT_MODES:
            weights = [QuantizedWeight(qtype, d, i, mode) for d, (_, i) in zip(data, shapes())]
            ways[f"{qtype} {mode}"] = [(w, w.in_features) for w in weights]
            nbytes[f"{qtype} {mode}"] = sum(w.nbytes for w in weights)
    print(f"{'way':<12} {'MB':>6}" + "".join(f" {'M=' + str(m) + ' ms':>10} {'GB/s':>6}" for m in args.rows))
    results = {name: {} for name in ways}
    for m in args.rows:
        xs = {i: torch.randn(m, i) for i in (HIDDEN, INTER)}
        times = {name: [] for name in ways}
        for name in ways:  # warm-up
            step(ways, name, xs)
        for _ in range(args.rounds):
            for name in ways:
                times[name].append(step(ways, name, xs))
        for name in ways:
            results[name][m] = statistics.median(times[name])
    for name in ways:
        cells = "".join(f" {results[name][m] * 1e3:10.2f} {nbytes[name] / results[name][m] / 1e9:6.1f}"
                        for m in args.rows)
        print(f"{name:<12} {nbytes[name] / 1e6:6.1f}{cells}")


if __name__ == "__main__":
    main()
