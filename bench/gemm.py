"""`tessera bench gemm`: the C GEMM on packed weights (kernels/gemm.c, `--linear-backend cpu`) beside
torch's MKL GEMMs on one step's projections, in one run.

For each row count M (a decode step's batch, or a prefill chunk's tokens) and dtype, the step's
dense work of the model in `--model-dir` (every layer's fused qkv, o, fused gate/up and down
projections, then the lm_head) is timed three ways on the same inputs: torch `F.linear`, torch
`W @ x.T` (the torch linear backend's orientation for 2..32 rows), and the C kernel on the same
weights packed once beforehand (as at load; packing is not timed). Weights are one distinct tensor
per layer, so, as in a real step, they stream from memory rather than sitting in cache. The three run
interleaved for `--rounds` rounds (this machine's speed drifts); the table gives medians. Outputs are
checked against each other. Rewrites bench/results/gemm.md. Never a test assertion.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from _decoder_proc import RESULTS, machine
from _flops import ModelShape


def step_weights(shape: ModelShape, dtype: torch.dtype) -> list[torch.Tensor]:
    """One step's weights [out, in]: per layer qkv, o, gate/up, down; then the lm_head."""
    hidden, inter = shape.hidden, shape.intermediate
    torch.manual_seed(0)
    weights = []
    for _ in range(shape.layers):
        for out_f, in_f in ((shape.q_width + 2 * shape.kv_width, hidden), (hidden, shape.q_width),
                            (2 * inter, hidden), (hidden, inter)):
            weights.append((torch.randn(out_f, in_f) * in_f ** -0.5).to(dtype))
    weights.append((torch.randn(shape.vocab, hidden) * hidden ** -0.5).to(dtype))
    return weights


def _inputs(weights: list[torch.Tensor], rows: int, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    return {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] for w in weights}}


def _time(fn, weights, xs) -> tuple[float, list[torch.Tensor]]:
    start = time.perf_counter()
    outs = [fn(xs[w.shape[1]], w) for w in weights]
    return time.perf_counter() - start, outs


def measure(weights: list[torch.Tensor], packed: dict, rows: int, dtype: torch.dtype, rounds: int) -> dict:
    """Median seconds per way over `rounds` interleaved rounds; `packed`: id(weight) -> PackedWeight."""
    xs = _inputs(weights, rows, dtype)
    ways = {"F.linear": lambda x, w: F.linear(x, w),
            "W @ x.T": lambda x, w: torch.mm(w, x.t()).t().contiguous(),
            "C GEMM": lambda x, w: packed[id(w)](x)}
    times = {name: [] for name in ways}
    error = 0.0
    for round_ in range(rounds + 1):  # round 0 warms up
        order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
        outs = {}
        for name in order:
            seconds, outs[name] = _time(ways[name], weights, xs)
            if round_:
                times[name].append(seconds)
        for ours, ref in zip(outs["C GEMM"], outs["F.linear"]):
            error = max(error, ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item())
    flops = 2 * rows * sum(w.numel() for w in weights)
    return {name: statistics.median(t) for name, t in times.items()} | {"error": error, "gflop": flops / 1e9}


def main(argv: list[str] | None = None) -> int:
    from services.decoder.linear import CpuGemm
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench gemm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 128, 512])
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    shape = ModelShape.read(args.model_dir)
    lines = ["# bench gemm", "", f"machine: {machine()}",
             f"model: {args.model_dir.name} ({shape.layers} layers x [qkv, o, gate/up, down] + lm_head "
             f"{shape.hidden} -> {shape.vocab}); weights distinct per layer (streamed from memory); "
             f"median of {args.rounds} interleaved rounds, ms per step's projections", ""]
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        weights = step_weights(shape, dtype)
        gemm = CpuGemm()
        packed = {id(w): gemm.pack(w) for w in weights}
        lines += [f"## {dtype_name}", "",
                  "| rows | torch F.linear | torch W @ x.T | C GEMM (packed) | C / best torch | C GFLOP/s | "
                  "max error vs F.linear (relative) |", "|---|---|---|---|---|---|---|"]
        for rows in args.rows:
            r = measure(weights, packed, rows, dtype, args.rounds)
            best = min(r["F.linear"], r["W @ x.T"])
            line = (f"| {rows} | {r['F.linear'] * 1e3:.1f} | {r['W @ x.T'] * 1e3:.1f} | {r['C GEMM'] * 1e3:.1f} "
                    f"| {r['C GEMM'] / best:.2f} | {r['gflop'] / r['C GEMM']:.0f} | {r['error']:.1e} |")
            print(f"[gemm] {dtype_name} {line}", flush=True)
            lines.append(line)
        lines.append("")
        del weights, packed
    lines += ["torch's bf16 GEMMs are emulated on CPUs without AVX512-BF16/AMX; the C kernel widens bf16 weights",
              "to float32 in registers (exact) and sums in float32 either way, so its bf16 reads half the bytes."]
    text = "\n".join(lines) + "\n"
    (RESULTS / "gemm.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
