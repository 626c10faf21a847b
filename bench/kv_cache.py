"""`tessera bench kv_cache`: the decoder with a bfloat16 KV cache (`--kv-cache-dtype bfloat16`) against
the same decoder with the model's float32 cache, measured in the same run.

Two decoders of the same float32 checkpoint and flags, alive together, differing only in the cache
dtype (bench/_pair.py: interleaved rounds, the order alternating). Workloads, over gRPC:

  - P1: 32 concurrent requests, prompts of 16-512 tokens, 16-256 generated (bench decode's workload);
  - long: 8 concurrent requests, prompts of 1536-1792 tokens, 128 generated: decode attention reads
    each row's whole context every step, so the cache's bytes weigh most here.

Generated tokens/s per workload (greedy, EOS ignored, new token ids every round: no prefix-cache
hits), medians and per-round ratios. Then what the cache costs: bytes per block and the blocks a
1 GiB budget holds (`KVBlockLayout`), each decoder's resident set after the runs, and the outputs:
how many of P1's greedy sequences are identical token for token between the two caches, and where
the others part (the rounding changes numbers, so long greedy continuations may part;
tests/decoder/test_kv_cache_dtype.py proves the rounding equals transformers' over a rounding cache).
Writes bench/results/kv_cache.md. Never a test assertion.

    tessera bench kv_cache [--model-dir DIR] [--rounds 3] [--flags "..."]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _decoder_proc import RESULTS, machine
from _pair import Workload, parted, random_work, run_pair

CACHES = ("auto", "bfloat16")  # the anchor (the model's float32) first


def main(argv: list[str] | None = None) -> int:
    from services.decoder.config import DecoderConfig
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench kv_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flags", default="", help="more flags for both decoders")
    parser.add_argument("--output", type=Path, default=RESULTS / "kv_cache.md")
    args = parser.parse_args(argv)

    common = ["--dtype", "float32", "--max-model-len", "2048", "--num-blocks", "1200", "--no-prefix-caching",
              *args.flags.split()]
    workloads = {"P1": Workload(random_work(0, 32, (16, 512), (16, 256))),
                 "long": Workload(random_work(1, 8, (1536, 1792), (128, 128)))}
    result = run_pair(args.model_dir, {cache: [*common, "--kv-cache-dtype", cache] for cache in CACHES}, workloads,
                      args.rounds, "kv_cache")
    configs = {cache: DecoderConfig(model_dir=str(args.model_dir), dtype="float32", kv_cache_dtype=cache,
                                    max_model_len=2048, kv_cache_memory_bytes=1 << 30) for cache in CACHES}
    same, first = parted(result.outputs["auto", "P1"], result.outputs["bfloat16", "P1"])
    lines = ["# A bfloat16 KV cache on a float32 model", "",
             f"Machine: {machine()}.", "",
             f"Model {args.model_dir.name} in float32; both decoders `{' '.join(common)}`, one with "
             "`--kv-cache-dtype bfloat16`, alive together, rounds interleaved (order alternating). "
             "Generated tokens/s (greedy, EOS ignored, new token ids each round). P1: 32 concurrent, prompts "
             "16-512, 16-256 new; long: 8 concurrent, prompts 1536-1792, 128 new.", "",
             "| workload | float32 cache (anchor) tok/s | bfloat16 cache tok/s | median ratio | per-round ratios |",
             "|---|---|---|---|---|", *(result.row(name, "auto", "bfloat16") for name in workloads),
             "", "| cache | bytes per block | blocks in a 1 GiB budget | decoder RSS after the runs (1200 blocks) |",
             "|---|---|---|---|"]
    for cache in CACHES:
        layout = configs[cache].kv_block_layout()
        lines.append(f"| {'float32 (auto)' if cache == 'auto' else cache} | {layout.bytes_per_block} "
                     f"({layout.describe()}) | {configs[cache].num_blocks} | {result.rss[cache]:.0f} MiB |")
    lines += ["", f"Outputs: {same} of {len(result.outputs['auto', 'P1'])} P1 greedy sequences identical token "
              "for token between the two caches" + (f"; the others part at positions {sorted(first)} (of 16-256 "
                                                    "generated)" if first else "") + ".", ""]
    text = "\n".join(lines)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
