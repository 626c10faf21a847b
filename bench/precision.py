"""`tessera bench precision`: the same checkpoint served in bfloat16 against float32 (the anchor),
measured in the same run, on this host or as an AVX2 host runs it (`--as-avx2`).

Two decoders, `--dtype float32` and `--dtype bfloat16`, otherwise the same flags, alive together
(bench/_pair.py: interleaved rounds, the order alternating). Workloads, over gRPC, greedy, EOS ignored,
new token ids every round:

  - P1: 32 concurrent requests, prompts of 16-512 tokens, 16-256 generated (bench decode's workload);
  - batch 1: 3 requests one after another, prompts of 128 tokens, 128 generated (tok/s of the whole
    requests, prefill included: what one user chatting sees).

`--as-avx2` runs both decoders as an AVX2 + FMA host without AVX-512 runs them: the C kernels built
for it (TESSERA_CPU_KERNELS=avx2: -march=haswell, so no VDPBF16PS and no AVX-512 GEMV; bf16 weights
widened to float32 in registers), torch's own kernels held to AVX2 (ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2) and `--linear-backend cpu`, which `auto` picks
on such a host. The memory system stays this machine's. Issue 37's targets: bf16 P1 >= 1.6x float32
on an avx512_bf16 host, >= 1.0x on an AVX2 host (bf16 never slower than float32). Writes
bench/results/precision.md (precision-avx2.md). Never a test assertion.

    tessera bench precision [--as-avx2] [--model-dir DIR] [--rounds 3] [--flags "..."]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _decoder_proc import RESULTS, machine
from _pair import Workload, random_work, run_pair

AVX2_ENV = {"TESSERA_CPU_KERNELS": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
DTYPES = ("float32", "bfloat16")  # the anchor first


def main(argv: list[str] | None = None) -> int:
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--as-avx2", action="store_true", help="run the decoders as an AVX2 host without AVX-512")
    parser.add_argument("--flags", default="", help="more flags for both decoders")
    args = parser.parse_args(argv)

    common = ["--max-model-len", "1024", "--no-prefix-caching", *args.flags.split()]
    if args.as_avx2:
        os.environ.update(AVX2_ENV)  # the decoders inherit it (services/common/launch.py service_env)
        common += ["--linear-backend", "cpu"]
    workloads = {"P1": Workload(random_work(0, 32, (16, 512), (16, 256))),
                 "batch 1": Workload(random_work(1, 3, (128, 128), (128, 128)), concurrent=False)}
    suffix = "-avx2" if args.as_avx2 else ""
    result = run_pair(args.model_dir, {dtype: [*common, "--dtype", dtype] for dtype in DTYPES}, workloads,
                      args.rounds, f"precision{suffix}")
    host = (" Run as an AVX2 host: " + ", ".join(f"{k}={v}" for k, v in AVX2_ENV.items())
            + ", `--linear-backend cpu`." if args.as_avx2 else "")
    lines = ["# bfloat16 against float32" + (", as an AVX2 host" if args.as_avx2 else ""), "",
             f"Machine: {machine()}.{host}", "",
             f"Model {args.model_dir.name}; both decoders `{' '.join(common)}`, one `--dtype float32` (the "
             "anchor), one `--dtype bfloat16`, alive together, rounds interleaved (order alternating). Generated "
             "tokens/s (greedy, EOS ignored, new token ids each round). P1: 32 concurrent, prompts 16-512, 16-256 "
             "new; batch 1: 3 requests one at a time, prompts 128, 128 new (whole requests).", "",
             "| workload | float32 tok/s (anchor) | bfloat16 tok/s | median ratio | per-round ratios |",
             "|---|---|---|---|---|", *(result.row(name, "float32", "bfloat16") for name in workloads), "",
             f"Decoder RSS after the runs: float32 {result.rss['float32']:.0f} MiB, bfloat16 "
             f"{result.rss['bfloat16']:.0f} MiB.", ""]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"precision{suffix}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
