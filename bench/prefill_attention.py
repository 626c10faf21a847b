"""`tessera bench prefill_attention`: the cpu backend's prefill-attention kernel
(kernels/prefill_attention.c) beside the torch path it replaced (SDPA's CPU flash kernel per span, K/V
gathered from the paged cache), in one run.

Causal spans from position 0 (n spans x L tokens), SmolLM2-135M's attention (9 heads, 3 kv heads,
head_dim 64) and a Llama-3-8B-shaped one (32 / 8 / 128), float32 and bfloat16, caches on scattered
blocks of 16. Medians of interleaved rounds (order alternating), ms per call of one layer; GFLOP/s
counts the causal half (2 * 2 * heads * L^2 / 2 * head_dim per span). Rewrites
bench/results/prefill_attention.md. Never a test assertion.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _decoder_proc import RESULTS, machine

SHAPES = {"smollm2-135m (9 heads, 3 kv, 64)": (9, 3, 64), "llama-3-8b (32 heads, 8 kv, 128)": (32, 8, 128)}
SPANS = [(8, 64), (4, 128), (4, 512), (2, 1024), (1, 2048)]  # (spans, tokens each)


def _case(num_heads, num_kv_heads, head_dim, spans, length, dtype):
    from services.decoder.attention.cpu_backend import CpuPrefillMetadata
    from services.decoder.attention.torch_backend import prefill_span

    gen = torch.Generator().manual_seed(0)
    blocks = spans * length // 16 + 4
    order = torch.randperm(blocks, generator=gen)
    k = torch.randn(num_kv_heads, blocks * 16, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_kv_heads, blocks * 16, head_dim, generator=gen).to(dtype)
    query = torch.randn(spans * length, num_heads, head_dim, generator=gen).to(dtype)
    prefills = []
    for s in range(spans):
        pos = torch.arange(length)
        table = order[s * length // 16:(s + 1) * length // 16]
        prefills.append(prefill_span(s * length, 0, table[pos // 16] * 16 + pos % 16))
    return query, k, v, prefills, CpuPrefillMetadata.of(prefills)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--output", type=Path, default=RESULTS / "prefill_attention.md")
    args = parser.parse_args(argv)

    from services.decoder.attention.cpu_backend import paged_prefill_attention
    from services.decoder.attention.torch_backend import prefill_attention

    lines = ["# bench prefill_attention", "", f"machine: {machine()}", "",
             f"Causal spans from position 0, caches on scattered blocks of 16; median of {args.rounds} interleaved "
             "rounds, ms per call (one layer); GFLOP/s of the causal half. Anchor: the torch path (SDPA's flash "
             "kernel per span over K/V gathered from the cache), which the cpu backend ran before.", ""]
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        lines += [f"## {name}", "", "| dtype | spans x tokens | torch path (SDPA) | C kernel | torch / C | C GFLOP/s "
                  "| max difference |", "|---|---|---|---|---|---|---|"]
        for dtype in (torch.float32, torch.bfloat16):
            for spans, length in SPANS:
                query, k, v, prefills, meta = _case(heads, kv_heads, head_dim, spans, length, dtype)
                scale = head_dim ** -0.5
                outs = {"torch": torch.empty_like(query), "c": torch.empty_like(query)}
                runs = {"torch": partial(prefill_attention, query, k, v, prefills, scale, outs["torch"]),
                        "c": partial(paged_prefill_attention, query, k, v, meta, scale, outs["c"])}
                times = {key: [] for key in runs}
                for fn in runs.values():
                    fn()
                for i in range(args.rounds):
                    for key in (("torch", "c") if i % 2 else ("c", "torch")):
                        start = time.perf_counter()
                        runs[key]()
                        times[key].append((time.perf_counter() - start) * 1e3)
                ours, anchor = statistics.median(times["c"]), statistics.median(times["torch"])
                flops = spans * 2 * heads * length * length * head_dim
                diff = (outs["c"].float() - outs["torch"].float()).abs().max().item()
                row = (f"| {str(dtype).removeprefix('torch.')} | {spans} x {length} | {anchor:.2f} | {ours:.2f} | "
                       f"{anchor / ours:.2f}x | {flops / ours / 1e6:.0f} | {diff:.1e} |")
                print(name, row, flush=True)
                lines.append(row)
        lines.append("")
    args.output.write_text("\n".join(lines))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
