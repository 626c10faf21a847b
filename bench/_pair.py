"""Shared by bench/kv_cache.py and bench/precision.py: two decoders of one checkpoint that differ in a
few flags, alive together, measured on the same workloads in interleaved rounds (the order alternating:
the machine's speed drifts), over gRPC."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from _decoder_proc import RESULTS, start_decoder, stop


@dataclass
class Workload:
    """Requests (prompt ids, max_tokens) sent all at once (`concurrent`) or one after another."""

    requests: list[tuple[list[int], int]]
    concurrent: bool = True


@dataclass
class PairResult:
    """Generated tokens/s per (variant, workload) per round, the first round's greedy ids per (variant,
    workload), and each decoder's VmRSS (MiB) after the runs."""

    rates: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    outputs: dict[tuple[str, str], list[list[int]]] = field(default_factory=dict)
    rss: dict[str, float] = field(default_factory=dict)

    def row(self, name: str, base: str, other: str) -> str:
        """A markdown row: the workload, each variant's median (its rounds), the median per-round ratio."""
        a, b = self.rates[base, name], self.rates[other, name]
        ratios = [y / x for x, y in zip(a, b)]
        runs = lambda values: ", ".join(f"{v:.1f}" for v in values)  # noqa: E731
        return (f"| {name} | {statistics.median(a):.1f} ({runs(a)}) | {statistics.median(b):.1f} ({runs(b)}) | "
                f"**{statistics.median(ratios):.2f}x** | {', '.join(f'{r:.2f}' for r in ratios)} |")


def random_work(seed: int, num: int, prompt_range: tuple[int, int], tokens_range: tuple[int, int]):
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(*prompt_range))], rng.randint(*tokens_range))
            for _ in range(num)]


def renumbered(requests, seed: int):
    """The same prompt lengths and max_tokens with new token ids (no prefix-cache hits across rounds)."""
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in prompt], n) for prompt, n in requests]


async def serve(address: str, work: Workload) -> tuple[float, list[list[int]]]:
    """Generated tokens/s of `work` (greedy, EOS ignored; wall time from the first request sent to
    the last token), and each request's ids."""
    import grpc

    from tessera.v1 import decoder_pb2, decoder_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderStub(channel)

        async def one(prompt, max_tokens):
            request = decoder_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=decoder_pb2.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
            return [t async for r in stub.Generate(request, timeout=3600) for t in r.token_ids]

        await one(work.requests[0][0][:8], 2)  # warm-up
        start = time.perf_counter()
        if work.concurrent:
            ids = await asyncio.gather(*(one(p, n) for p, n in work.requests))
        else:
            ids = [await one(p, n) for p, n in work.requests]
        wall = time.perf_counter() - start
    return sum(map(len, ids)) / wall, list(ids)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_pair(model_dir: Path, variants: dict[str, list[str]], workloads: dict[str, Workload], rounds: int,
             log_prefix: str) -> PairResult:
    """Start one decoder per variant (its flags), then `rounds` rounds of every workload on each
    (new token ids each round, the variants' order alternating), then stop them."""
    decoders, result = {}, PairResult()
    try:
        for label, flags in variants.items():
            decoders[label] = start_decoder(model_dir, flags, RESULTS / f"{log_prefix}-{label}.log")
        labels = list(variants)
        for r in range(rounds):
            for w, (name, work) in enumerate(workloads.items()):
                fresh = Workload(renumbered(work.requests, 1000 * w + r + 1), work.concurrent)
                for label in labels if r % 2 == 0 else labels[::-1]:
                    rate, ids = asyncio.run(serve(decoders[label][1], fresh))
                    result.rates.setdefault((label, name), []).append(rate)
                    result.outputs.setdefault((label, name), ids)
                    print(f"round {r + 1} {name} {label}: {rate:.1f} tok/s", flush=True)
        result.rss = {label: rss_mib(process.pid) for label, (process, _) in decoders.items()}
    finally:
        for process, _ in decoders.values():
            stop(process)
    return result


def parted(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[int]]:
    """(sequences identical, the first differing position of each other one)."""
    same, first = 0, []
    for x, y in zip(a, b):
        if x == y:
            same += 1
        else:
            first.append(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))))
    return same, first
