"""`tessera bench prefix`: time to first token with a shared prefix, prefix-cache hit vs miss.

In one run on one machine, against `python -m services.decoder` over gRPC:
  1. warm: a request with prefix P (default 1024 tokens) + suffix, so P's full blocks are cached;
  2. hit: requests P + a new suffix (TTFT measured to the first streamed token);
  3. miss: requests with a fresh prefix of the same length + suffix (nothing cached);
  4. anchor: the same miss with `--no-prefix-caching` on a second server.
Target: miss TTFT / hit TTFT >= 5. Prints one table and rewrites bench/results/prefix.md.
Never a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _decoder_proc import RESULTS, machine, start_decoder, stop


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


async def _ttft(stub, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the final usage's cached_prompt_tokens."""
    from tessera.v1 import decoder_pb2

    request = decoder_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=decoder_pb2.SamplingParams(
        max_tokens=2, ignore_eos=True))
    start, first, cached = time.perf_counter(), None, 0
    async for response in stub.Generate(request, timeout=600):
        if first is None and response.token_ids:
            first = time.perf_counter() - start
        if response.HasField("usage"):
            cached = response.usage.cached_prompt_tokens
    return first, cached


async def _measure(address: str, prefix_len: int, repeats: int, seed: int) -> dict:
    import grpc

    from tessera.v1 import decoder_pb2_grpc

    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderStub(channel)
        await _ttft(stub, _tokens(rng, 16))                   # warm-up
        await _ttft(stub, prefix + _tokens(rng, 16))         # caches the prefix's full blocks
        hits = [await _ttft(stub, prefix + _tokens(rng, 16)) for _ in range(repeats)]
        misses = [await _ttft(stub, _tokens(rng, prefix_len + 16)) for _ in range(repeats)]
    return {"hit": statistics.median(t for t, _ in hits), "hit_cached": hits[0][1],
            "miss": statistics.median(t for t, _ in misses), "miss_cached": misses[0][1]}


def main(argv: list[str] | None = None) -> int:
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench prefix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    flags = ["--max-model-len", "2048"]
    process, address = start_decoder(args.model_dir, flags, RESULTS / "prefix-server.log")
    try:
        cached = asyncio.run(_measure(address, args.prefix_len, args.repeats, seed=1))
    finally:
        stop(process)
    process, address = start_decoder(args.model_dir, [*flags, "--no-prefix-caching"], RESULTS / "prefix-server-off.log")
    try:
        off = asyncio.run(_measure(address, args.prefix_len, args.repeats, seed=2))
    finally:
        stop(process)
    rows = [("prefix-cache hit", cached["hit"], cached["hit_cached"]),
            ("prefix-cache miss (fresh prefix)", cached["miss"], cached["miss_cached"]),
            ("no prefix caching (anchor)", off["hit"], off["hit_cached"])]
    lines = ["# bench prefix\n", f"machine: {machine()}", f"model: {args.model_dir.name}, fp32",
             f"prompt: {args.prefix_len}-token shared prefix + 16-token suffix; median of {args.repeats}\n",
             "| mode | TTFT ms | cached prompt tokens | miss / this |", "|---|---|---|---|"]
    lines += [f"| {name} | {1000 * t:.1f} | {c} | {cached['miss'] / t:.2f} |" for name, t, c in rows]
    lines += ["", f"hit speed-up (miss / hit): {cached['miss'] / cached['hit']:.1f}x (target >= 5x)"]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prefix.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
