"""`tessera bench model_impl`: one checkpoint served natively and through transformers' modeling code.

The same decoder, the same checkpoint, `--model-impl native` against `--model-impl transformers`
(transformers' own layers with tessera's paged attention plugged in, model_transformers.py), each
over gRPC with N concurrent requests (default 16; prompt lengths and max_tokens drawn from the
given ranges, EOS ignored), in alternating rounds (native, transformers, native, ...: this
machine's speed drifts, so each round of one is next to a round of the other; new token ids each
round, so no prefix-cache hits); and the anchor, transformers' `generate` in process on the same
work in left-padded batches of 16. Reports the median generated tokens/s of each and the ratios;
issue 34's target: native >= 1.5x the transformers path at 16 concurrent requests. Writes
bench/results/model_impl.md. Never a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _decoder_proc import RESULTS, machine, start_decoder, stop
from decode import _grpc_run, fresh_tokens, hf_batched, workload

from tessera.paths import default_decoder_dir

IMPLS = ("native", "transformers")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tessera bench model_impl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--tokens-range", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each path, alternating")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = workload(args.num_requests, tuple(args.prompt_range), tuple(args.tokens_range))
    flags = ["--max-model-len", "2048", "--dtype", args.dtype]
    servers = {impl: start_decoder(args.model_dir, [*flags, "--model-impl", impl],
                                   RESULTS / f"model-impl-{impl}.log") for impl in IMPLS}
    runs: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    try:
        for round_ in range(args.rounds):
            for impl in IMPLS:
                seed = 1 + round_ * len(IMPLS) + IMPLS.index(impl)
                runs[impl].append(asyncio.run(_grpc_run(servers[impl][1], fresh_tokens(work, seed))))
    finally:
        for process, _ in servers.values():
            stop(process)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()
    anchor = hf_batched(model, work)
    text = report(args, work, runs, anchor)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "model_impl.md").write_text(text)
    return 0


def report(args, work, runs: dict[str, list[float]], anchor: float) -> str:
    native, transformers = (statistics.median(runs[impl]) for impl in IMPLS)
    tokens = sum(n for _, n in work)
    lines = ["# bench model_impl\n", f"machine: {machine()}", f"model: {args.model_dir.name}, {args.dtype}",
             f"workload: {len(work)} concurrent requests, prompts {args.prompt_range[0]}-{args.prompt_range[1]} "
             f"tokens, max_tokens {args.tokens_range[0]}-{args.tokens_range[1]} (EOS ignored), {tokens} generated "
             f"tokens; {args.rounds} rounds of each path, alternating\n",
             "| path | tokens/s (median) | rounds | native / this |", "|---|---|---|---|",
             f"| tessera decoder, --model-impl native | {native:.1f} | {', '.join(f'{r:.1f}' for r in runs['native'])} "
             "| 1.00 |",
             f"| tessera decoder, --model-impl transformers | {transformers:.1f} | "
             f"{', '.join(f'{r:.1f}' for r in runs['transformers'])} | {native / transformers:.2f} |",
             f"| transformers generate, padded batches of 16 (in process, after the rounds) | {anchor:.1f} | 1 | "
             f"{native / anchor:.2f} |",
             "", "Target (issue 34): native >= 1.5x the transformers path at 16 concurrent requests."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
