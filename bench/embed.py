"""`tessera bench embed`: 64 concurrent gRPC clients sending single sentences vs in-process sentence-transformers.

Runs, in one process on one machine:
  1. sentence-transformers `encode(batch_size=32)` over the sentences in process (the ceiling);
  2. `python -m services.pooling` with dynamic batching, N concurrent clients each sending one
     sentence per Embed call;
  3. the same server with `--no-dynamic-batching` (one forward per call under a lock).
Prints throughput (sentences/s) and p50/p99 latency, and writes bench/results/embed.md. Never a
test assertion: numbers depend on the machine and its load.

Then the mixed-length workload: requests of 56 short texts and 8 of ~230 tokens, each
embedded in process (a) as one forward padded to its longest text, as a batcher without length
grouping runs it (the anchor), and (b) through `PoolingEngine.embed`, whose batcher groups by
length; interleaved over `--rounds`, median seconds per request, rows checked equal. Writes
bench/results/embed-mixed.md (`--mixed-only` runs just this).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import grpc

from services.common.launch import ServiceProcess

REPO = Path(__file__).resolve().parents[1]
WORDS = ["river", "mountain", "weather", "spring", "model", "vector", "search", "engine", "query", "document", "city", "music", "garden", "history", "science", "language", "ocean", "forest", "market", "energy", "travel", "coffee", "morning", "library"]


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) + "." for i in range(count)]


def mixed_request(seed: int, num_short: int = 56, num_long: int = 8, long_words: int = 215) -> list[str]:
    """`num_short` sentences of 4-24 words and `num_long` texts of `long_words` words, interleaved."""
    rng = random.Random(seed)
    long_texts = [" ".join(rng.choice(WORDS) for _ in range(long_words)) + "." for _ in range(num_long)]
    texts = sentences(num_short, seed)
    for i, text in enumerate(long_texts):
        texts.insert(i * (len(texts) // num_long + 1), text)
    return texts


def run_mixed(model_dir: Path, num_requests: int, rounds: int) -> dict:
    """Seconds per mixed request: one padded forward vs the length-grouping batcher (see the docstring)."""
    import statistics

    import torch

    from services.pooling.config import ModelConfig, PoolingConfig
    from services.pooling.engine import PoolingEngine, load_served_model

    loaded = load_served_model(ModelConfig(model_dir=model_dir))
    engine = PoolingEngine(PoolingConfig(models=[loaded.config]), models={loaded.name: loaded})
    batcher = engine._models[loaded.name].batcher
    requests = [mixed_request(seed) for seed in range(num_requests)]
    lengths = [len(ids) for ids in loaded.tokenizer.encode_texts(requests[0])]

    def padded(texts):
        return loaded.runner.forward(loaded.tokenizer.encode_texts(texts))

    def grouped(texts):
        return asyncio.run(engine.embed(texts, normalize=False)).vectors

    grouped(requests[0][:2])  # warm-up
    times: dict[str, list[float]] = {"padded": [], "grouped": []}
    max_diff = 0.0
    for round_index in range(rounds):
        order = ("padded", "grouped") if round_index % 2 == 0 else ("grouped", "padded")
        rows = {}
        for mode in order:
            run = padded if mode == "padded" else grouped
            batcher.batch_shapes.clear()
            start = time.perf_counter()
            rows[mode] = [run(texts) for texts in requests]
            times[mode].append((time.perf_counter() - start) / num_requests)
            if mode == "grouped":
                shapes = list(batcher.batch_shapes)[: len(batcher.batch_shapes) // num_requests]  # one request's
        max_diff = max(max_diff, max(float((a - torch.as_tensor(b)).abs().max())
                                     for a, b in zip(rows["padded"], rows["grouped"], strict=True)))
    before, after = statistics.median(times["padded"]), statistics.median(times["grouped"])
    return {"before_s": before, "grouped_s": after, "speedup": before / after, "times": times,
            "max_diff": max_diff, "lengths": lengths, "shapes": shapes}


def mixed_report(result: dict, num_requests: int, rounds: int) -> str:
    lengths = result["lengths"]
    padded_before = len(lengths) * max(lengths)
    padded_grouped = sum(rows * length for rows, length in result["shapes"])
    return "\n".join([
        f"One request = {len(lengths)} texts: {sum(1 for n in lengths if n < 64)} short "
        f"({min(lengths)}-{max(n for n in lengths if n < 64)} tokens) and {sum(1 for n in lengths if n >= 64)} long "
        f"(~{max(lengths)} tokens), {sum(lengths)} real tokens; {num_requests} requests per round, {rounds} rounds "
        f"interleaved; target >= 3x.", "",
        "| mode | forwards per request (rows x padded length) | padded tokens | s per request (median) | speedup |",
        "|---|---|---|---|---|",
        f"| one padded batch (no grouping) | 1 ({len(lengths)} x {max(lengths)}) | {padded_before} | "
        f"{result['before_s']:.3f} | 1.00x |",
        f"| grouped by length | {len(result['shapes'])} ({', '.join(f'{r} x {n}' for r, n in result['shapes'])}) | "
        f"{padded_grouped} | {result['grouped_s']:.3f} | {result['speedup']:.2f}x |", "",
        f"Largest difference between the two modes' rows: {result['max_diff']:.2e}."])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_in_process(model_dir: Path, texts: list[str], batch_size: int = 32) -> dict:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    model.encode(texts[:batch_size], batch_size=batch_size)  # warm-up
    latencies, start = [], time.perf_counter()
    for i in range(0, len(texts), batch_size):
        t0 = time.perf_counter()
        model.encode(texts[i : i + batch_size], batch_size=batch_size)
        latencies.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    return {"mode": f"in-process encode(batch_size={batch_size})", "throughput": len(texts) / wall,
            "p50_ms": 1000 * _percentile(latencies, 0.5), "p99_ms": 1000 * _percentile(latencies, 0.99),
            "latency_of": f"one batch of {batch_size}"}


def _start_server(model_dir: Path, extra: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    service = ServiceProcess("services.pooling", ["--model-dir", str(model_dir), *extra],
                             env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)}, startup_s=120, log_path=log_path)
    service.start()
    return service.process, service.address


async def _clients(address: str, texts: list[str], num_clients: int) -> tuple[float, list[float]]:
    from tessera.v1 import pooling_pb2, pooling_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pooling_pb2_grpc.PoolingStub(channel)
        await stub.Embed(pooling_pb2.EmbedRequest(inputs=texts[:1]), timeout=60)  # warm-up
        queue: asyncio.Queue = asyncio.Queue()
        for text in texts:
            queue.put_nowait(text)
        latencies: list[float] = []

        async def client() -> None:
            while not queue.empty():
                text = queue.get_nowait()
                t0 = time.perf_counter()
                await stub.Embed(pooling_pb2.EmbedRequest(inputs=[text]), timeout=300)
                latencies.append(time.perf_counter() - t0)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(num_clients)))
        return time.perf_counter() - start, latencies


def run_server(model_dir: Path, texts: list[str], num_clients: int, batching: bool, log_dir: Path) -> dict:
    extra = [] if batching else ["--no-dynamic-batching"]
    process, address = _start_server(model_dir, extra, log_dir / f"pooling-{'batched' if batching else 'lock'}.log")
    try:
        wall, latencies = asyncio.run(_clients(address, texts, num_clients))
    finally:
        process.terminate()
        process.wait(timeout=30)
    mode = "gRPC, dynamic batching" if batching else "gRPC, per-call lock"
    return {"mode": f"{mode} ({num_clients} clients)", "throughput": len(texts) / wall,
            "p50_ms": 1000 * _percentile(latencies, 0.5), "p99_ms": 1000 * _percentile(latencies, 0.99),
            "latency_of": "one single-sentence call"}


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return (f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), python {platform.python_version()}")


def table(rows: list[dict], reference: float) -> str:
    lines = ["| mode | sentences/s | x in-process | p50 ms | p99 ms | latency of |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['throughput']:.1f} | {r['throughput'] / reference:.2f} | "
                     f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['latency_of']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tessera.paths import default_embedding_dir

    parser = argparse.ArgumentParser(prog="tessera bench embed", description=__doc__)
    parser.add_argument("--model-dir", type=Path, default=default_embedding_dir())
    parser.add_argument("--num-sentences", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--no-lock-baseline", action="store_true", help="skip the per-call lock run")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "embed.md")
    parser.add_argument("--mixed-only", action="store_true", help="run only the mixed-length workload")
    parser.add_argument("--mixed-requests", type=int, default=4, help="mixed requests per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the mixed workload")
    args = parser.parse_args(argv)
    if not args.mixed_only:
        run_concurrent(args)
    result = run_mixed(args.model_dir, args.mixed_requests, args.rounds)
    report = mixed_report(result, args.mixed_requests, args.rounds)
    print(report)
    mixed_path = args.output.with_name("embed-mixed.md")
    mixed_path.write_text(f"# tessera bench embed: mixed lengths\n\nMachine: {machine()}\n\nModel: "
                          f"{args.model_dir.name}. {report}\n")
    print(f"wrote {mixed_path}")
    return 0


def run_concurrent(args) -> None:
    texts = sentences(args.num_sentences)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    rows = [run_in_process(args.model_dir, texts)]
    rows.append(run_server(args.model_dir, texts, args.clients, True, args.output.parent))
    if not args.no_lock_baseline:
        rows.append(run_server(args.model_dir, texts, args.clients, False, args.output.parent))
    report = table(rows, rows[0]["throughput"])
    print(report)
    args.output.write_text(f"# tessera bench embed\n\nMachine: {machine()}\n\nModel: {args.model_dir.name}, "
                           f"{len(texts)} sentences (4-24 words), target >= 0.7x in-process.\n\n{report}\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    sys.exit(main())
