"""`tessera bench linear_backend`: the C GEMM (`--linear-backend cpu`) against torch's (MKL / oneDNN,
`--linear-backend torch`, the anchor) on this host, measured in the same run, per dtype.

Two decoders of one checkpoint that differ only in `--linear-backend`, alive together (bench/_pair.py:
interleaved rounds, the order alternating), for `--dtype` float32 and then bfloat16 (`--dtypes`).
Workloads over gRPC, greedy, EOS ignored, new token ids every round:

  - P1: 32 concurrent requests, prompts of 16-512 tokens, 16-256 generated (bench decode's workload);
  - batch 1: 3 requests one after another, prompts of 128 tokens, 128 generated (whole requests).

What `--linear-backend auto` picks on a CPU (services/decoder/linear.py `resolve_linear_backend`) rests
on these figures; the table says which it picks here. Writes bench/results/linear_backend.md. Never a
test assertion.

    tessera bench linear_backend [--model-dir DIR] [--rounds 3] [--dtypes float32,bfloat16] [--flags "..."]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _decoder_proc import RESULTS, machine
from _pair import Workload, random_work, run_pair

BACKENDS = ("torch", "cpu")  # the anchor first


def main(argv: list[str] | None = None) -> int:
    import torch

    from services.decoder.linear import resolve_linear_backend
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench linear_backend", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--flags", default="", help="more flags for both decoders")
    args = parser.parse_args(argv)

    common = ["--max-model-len", "1024", "--no-prefix-caching", *args.flags.split()]
    workloads = {"P1": Workload(random_work(0, 32, (16, 512), (16, 256))),
                 "batch 1": Workload(random_work(1, 3, (128, 128), (128, 128)), concurrent=False)}
    lines = ["# The C GEMM against torch's, per dtype", "", f"Machine: {machine()}.", "",
             f"Model {args.model_dir.name}; both decoders `{' '.join(common)} --dtype DTYPE`, one `--linear-backend "
             "torch` (the anchor), one `--linear-backend cpu`, alive together, rounds interleaved (order alternating). "
             "Generated tokens/s (greedy, EOS ignored, new token ids each round). P1: 32 concurrent, prompts 16-512, "
             "16-256 new; batch 1: 3 requests one at a time, prompts 128, 128 new (whole requests).", "",
             "| dtype | workload | torch tok/s (anchor) | cpu tok/s | median ratio | per-round ratios |",
             "|---|---|---|---|---|---|"]
    picks = []
    for dtype in args.dtypes.split(","):
        result = run_pair(args.model_dir, {b: [*common, "--dtype", dtype, "--linear-backend", b] for b in BACKENDS},
                          workloads, args.rounds, f"linear_backend-{dtype}")
        lines += [f"| {dtype} | {result.row(name, 'torch', 'cpu')[2:]}" for name in workloads]
        picks.append(f"{dtype}: {resolve_linear_backend('auto', torch.device('cpu'), dtype)}")
    lines += ["", f"`--linear-backend auto` picks here: {', '.join(picks)}.", ""]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "linear_backend.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
