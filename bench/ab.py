"""`tessera bench ab --before DIR`: the same decode and multi-LoRA workloads against two checkouts of
tessera, interleaved, to show a change is within noise of what it replaced.

Each round starts, for each checkout in turn (the order alternates per round), an adapter registry
and a decoder from that checkout's own package (`services`, or `tessera` in a checkout from before the move) (cwd = the checkout), and measures:
  - decode: N concurrent requests of random token ids (no adapter), generated tokens/s;
  - lora: the same N requests spread round-robin over K random rank-R PEFT adapters.
Both checkouts see the same prompts, adapters and flags. Reported: per-round figures, medians and the
median of the per-round after/before ratios. Writes bench/results/ab.md. Never a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _decoder_proc import REPO, RESULTS, free_port, machine
from lora import _grpc_run, _load, make_adapters

from services.common.launch import wait_serving


def _start(checkout: Path, module: str, args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """`python -m MODULE` with cwd and PYTHONPATH = `checkout`, so that checkout's code runs."""
    address = f"127.0.0.1:{free_port()}"
    if not (checkout / "services" / "decoder").is_dir():  # a checkout with the services under tessera/
        module = module.replace("services.", "tessera.", 1)
    env = {**os.environ, "PYTHONPATH": str(checkout), "TESSERA_ADMIN_TOKEN": "",
           "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", module, "--address", address, *args], cwd=checkout, env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_serving(address, process, 300.0, address, lambda: f"see {log}")
    except BaseException:
        process.kill()
        raise
    return process, address


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def one_round(checkout: Path, model_dir: Path, root: Path, names: list[str], prompts, args) -> tuple[float, float]:
    """(decode tok/s, multi-LoRA tok/s) of one checkout."""
    tag = checkout.name
    catalog = root / f"catalog-{tag}-{time.monotonic_ns()}.sqlite3"  # a fresh catalog each start
    registry, registry_address = _start(checkout, "services.adapters",
                                        ["--root", str(root), "--db", str(catalog), "--base-model-dir", str(model_dir),
                                         "--max-rank", str(args.rank)], RESULTS / f"ab-{tag}-registry.log")
    try:
        asyncio.run(_load(registry_address, names))
        flags = ["--model-dir", str(model_dir), "--adapters-address", registry_address,
                 "--adapter-slots", str(len(names)), "--max-lora-rank", str(args.rank), "--max-model-len", "1024",
                 "--no-prefix-caching", *args.decoder_flags.split()]
        decoder, address = _start(checkout, "services.decoder", flags, RESULTS / f"ab-{tag}-decoder.log")
        try:
            decode = asyncio.run(_grpc_run(address, [(p, "") for p in prompts], args.max_tokens))
            lora = asyncio.run(_grpc_run(address, [(p, names[i % len(names)]) for i, p in enumerate(prompts)],
                                         args.max_tokens))
        finally:
            _stop(decoder)
    finally:
        _stop(registry)
    return decode, lora


def main(argv: list[str] | None = None) -> int:
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    parser.add_argument("--after", type=Path, default=REPO, help="default: this checkout")
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--decoder-flags", default="", help="extra flags for both decoders, e.g. '--lora-backend cpu'")
    args = parser.parse_args(argv)
    before, after = args.before.resolve(), args.after.resolve()
    RESULTS.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    figures: dict[Path, list[tuple[float, float]]] = {before: [], after: []}
    with tempfile.TemporaryDirectory(prefix="tessera-bench-ab-") as tmp:
        root = Path(tmp)
        names = make_adapters(args.model_dir, root, args.adapters, args.rank)
        for round_ in range(args.rounds):
            for checkout in ((before, after) if round_ % 2 == 0 else (after, before)):
                figures[checkout].append(one_round(checkout, args.model_dir, root, names, prompts, args))
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    lines = ["# bench ab\n", f"machine: {machine()}",
             f"before: {before} ({_describe(before)})", f"after: {after} ({_describe(after)})",
             f"workload: {args.requests} concurrent requests, {args.prompt_len}-token random prompts, {args.max_tokens} "
             f"new tokens (EOS ignored); lora: round-robin over {args.adapters} rank-{args.rank} adapters; "
             f"decoder flags: {args.decoder_flags or '(defaults)'}; {args.rounds} rounds, order alternating\n",
             "| workload | before tok/s (rounds) | after tok/s (rounds) | after/before (median of rounds) |",
             "|---|---|---|---|"]
    for column, label in ((0, "decode"), (1, "multi-LoRA")):
        b = [f[column] for f in figures[before]]
        a = [f[column] for f in figures[after]]
        ratio = median([x / y for x, y in zip(a, b, strict=True)])
        lines.append(f"| {label} | {median(b):.1f} ({', '.join(f'{v:.1f}' for v in b)}) | "
                     f"{median(a):.1f} ({', '.join(f'{v:.1f}' for v in a)}) | {ratio:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "ab.md").write_text(text)
    return 0


def _describe(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return done.stdout.strip()[:80] or "not a git checkout"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
