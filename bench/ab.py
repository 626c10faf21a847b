"""`tessera bench ab --before DIR`: the same decode, multi-LoRA and HTTP chat workloads against two
checkouts of tessera, interleaved, to show a change is within noise of what it replaced.

Each round starts, for each checkout in turn (the order alternates per round), an adapter registry
and a decoder from that checkout's own package (`services`, or `tessera` in a checkout from before the
move) (cwd = the checkout), and measures (`--workloads` picks them):
  - decode: N concurrent requests of random token ids (no adapter), generated tokens/s;
  - lora: the same N requests spread round-robin over K random rank-R PEFT adapters;
  - http: a gateway of that checkout with its HTTP API in front of the decoder (no vision, no pooling
    behind it); `--http-chats` short chats (one user message, temperature 0, `--http-max-tokens`
    tokens, EOS ignored) through POST /v1/chat/completions, `--http-concurrency` at a time, each
    client thread on its own keep-alive connection; completed chats/s and completion tokens/s.
Both checkouts see the same prompts, adapters and flags. Reported: per-round figures, medians, the
median of the per-round after/before ratios and the load average at start and end (the host may be
shared). Writes bench/results/ab.md. Never a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
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


WORKLOADS = ("decode", "lora", "http")


def one_round(checkout: Path, model_dir: Path, root: Path, names: list[str], prompts, args) -> dict[str, float]:
    """Figures of one checkout: decode and lora in generated tok/s; http_chats in chats/s and http_tokens
    in completion tok/s (only the workloads asked)."""
    tag = checkout.name
    catalog = root / f"catalog-{tag}-{time.monotonic_ns()}.sqlite3"  # a fresh catalog each start
    registry, registry_address = _start(checkout, "services.adapters",
                                        ["--root", str(root), "--db", str(catalog), "--base-model-dir", str(model_dir),
                                         "--max-rank", str(args.rank)], RESULTS / f"ab-{tag}-registry.log")
    out: dict[str, float] = {}
    try:
        asyncio.run(_load(registry_address, names))
        flags = ["--model-dir", str(model_dir), "--adapters-address", registry_address,
                 "--adapter-slots", str(len(names)), "--max-lora-rank", str(args.rank), "--max-model-len", "1024",
                 "--no-prefix-caching", *args.decoder_flags.split()]
        decoder, address = _start(checkout, "services.decoder", flags, RESULTS / f"ab-{tag}-decoder.log")
        try:
            if "decode" in args.workloads:
                out["decode"] = asyncio.run(_grpc_run(address, [(p, "") for p in prompts], args.max_tokens))
            if "lora" in args.workloads:
                out["lora"] = asyncio.run(_grpc_run(address, [(p, names[i % len(names)]) for i, p in enumerate(prompts)],
                                                    args.max_tokens))
            if "http" in args.workloads:
                out["http_chats"], out["http_tokens"] = _http_round(checkout, address, registry_address, args)
        finally:
            _stop(decoder)
    finally:
        _stop(registry)
    return out


def _http_round(checkout: Path, decoder_address: str, registry_address: str, args) -> tuple[float, float]:
    """(chats/s, completion tok/s) through a gateway of `checkout` started for this round with the
    flags `tessera up --no-vision` gives it (pooling's address answers nothing: chats never reach it)."""
    http_port = free_port()
    gateway, _ = _start(checkout, "services.gateway",
                        ["--decoder", decoder_address, "--pooling", f"127.0.0.1:{free_port()}",
                         "--adapters", registry_address, "--vision", "", "--http-port", str(http_port)],
                        RESULTS / f"ab-{checkout.name}-gateway.log")
    try:
        url = f"127.0.0.1:{http_port}"
        model = _base_model(url, gateway)
        _chats(url, model, range(args.http_concurrency), args.http_concurrency, 2)  # warm-up, untimed
        start = time.perf_counter()
        tokens = _chats(url, model, range(args.http_chats), args.http_concurrency, args.http_max_tokens)
        elapsed = time.perf_counter() - start
    finally:
        _stop(gateway)
    return args.http_chats / elapsed, tokens / elapsed


def _base_model(url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> str:
    """The id GET /v1/models lists with no parent (adapters name the base as their parent), asked
    until the HTTP API answers 200 (it may open after gRPC says SERVING; /health is not asked: it
    answers 503 while pooling, absent here, does not serve)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited with code {process.returncode} before its HTTP API answered")
        try:
            connection = http.client.HTTPConnection(url, timeout=30)
            connection.request("GET", "/v1/models")
            reply = connection.getresponse()
            if reply.status == 200:
                data = json.loads(reply.read())["data"]
                return next((m["id"] for m in data if not m.get("parent")), data[0]["id"])
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"gateway HTTP at {url}: GET /v1/models not 200 after {timeout_s:.0f} s")


def _chats(url: str, model: str, chat_ids: range, concurrency: int, max_tokens: int) -> int:
    """Completion tokens of the chats `chat_ids`, sent by `concurrency` threads, each one chat at a
    time on its own keep-alive connection (stdlib http.client: the venv has no async HTTP client)."""
    def worker(ids: range) -> int:
        connection = http.client.HTTPConnection(url, timeout=600)
        tokens = 0
        try:
            for i in ids:
                body = json.dumps({"model": model, "messages": [{"role": "user", "content": f"Say a word ({i})."}],
                                   "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
                connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                reply = connection.getresponse()
                data = reply.read()
                if reply.status != 200:
                    raise RuntimeError(f"chat answered {reply.status}: {data[:200]!r}")
                tokens += json.loads(data)["usage"]["completion_tokens"]
        finally:
            connection.close()
        return tokens

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(worker, [chat_ids[w::concurrency] for w in range(concurrency)]))


def main(argv: list[str] | None = None) -> int:
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    parser.add_argument("--after", type=Path, default=REPO, help="default: this checkout")
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--http-chats", type=int, default=32, help="timed chats per round")
    parser.add_argument("--http-concurrency", type=int, default=16)
    parser.add_argument("--http-max-tokens", type=int, default=16)
    parser.add_argument("--decoder-flags", default="", help="extra flags for both decoders, e.g. '--lora-backend cpu'")
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown or not args.workloads:
        parser.error(f"--workloads: {', '.join(unknown) or 'none given'}; known: {', '.join(WORKLOADS)}")
    before, after = args.before.resolve(), args.after.resolve()
    RESULTS.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    figures: dict[Path, list[dict[str, float]]] = {before: [], after: []}
    loads = [os.getloadavg()]  # at start, before each checkout's run, at end
    with tempfile.TemporaryDirectory(prefix="tessera-bench-ab-") as tmp:
        root = Path(tmp)
        names = make_adapters(args.model_dir, root, args.adapters, args.rank)
        for round_ in range(args.rounds):
            for checkout in ((before, after) if round_ % 2 == 0 else (after, before)):
                loads.append(os.getloadavg())
                figures[checkout].append(one_round(checkout, args.model_dir, root, names, prompts, args))
    loads.append(os.getloadavg())
    text = _report(args, before, after, figures, loads)
    print(text)
    (RESULTS / "ab.md").write_text(text)
    return 0


def _report(args, before: Path, after: Path, figures: dict[Path, list[dict[str, float]]], loads) -> str:
    """bench/results/ab.md: one row per workload, medians and every round's figure; `loads` are
    os.getloadavg() at start, before each checkout's run (in run order) and at end."""
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    load = lambda avg: "/".join(f"{v:.2f}" for v in avg)  # noqa: E731
    lines = ["# bench ab\n", f"machine: {machine()}",
             f"load average (1/5/15 min): {load(loads[0])} at start, {load(loads[-1])} at end; 1-min load before "
             f"each checkout's run, in run order: {', '.join(f'{v[0]:.2f}' for v in loads[1:-1])} (a shared host: "
             f"other processes ran beside the benchmark)",
             f"before: {before} ({_describe(before)})", f"after: {after} ({_describe(after)})",
             f"workload: {args.requests} concurrent requests, {args.prompt_len}-token random prompts, {args.max_tokens} "
             f"new tokens (EOS ignored); lora: round-robin over {args.adapters} rank-{args.rank} adapters; "
             f"http: {args.http_chats} chats, {args.http_concurrency} at a time, one short user message, "
             f"{args.http_max_tokens} tokens each (temperature 0, EOS ignored), gateway with HTTP in front of the "
             f"decoder; decoder flags: {args.decoder_flags or '(defaults)'}; {args.rounds} rounds, order alternating\n",
             "| workload | before (rounds) | after (rounds) | after/before (median of rounds) |",
             "|---|---|---|---|"]
    rows = (("decode", "decode, tok/s", 1), ("lora", "multi-LoRA, tok/s", 1), ("http_chats", "HTTP chat, chats/s", 2),
            ("http_tokens", "HTTP chat, completion tok/s", 1))
    for key, label, digits in rows:
        if key not in figures[before][0]:
            continue
        b = [f[key] for f in figures[before]]
        a = [f[key] for f in figures[after]]
        ratio = median([x / y for x, y in zip(a, b, strict=True)])
        lines.append(f"| {label} | {median(b):.{digits}f} ({', '.join(f'{v:.{digits}f}' for v in b)}) | "
                     f"{median(a):.{digits}f} ({', '.join(f'{v:.{digits}f}' for v in a)}) | {ratio:.2f}x |")
    return "\n".join(lines) + "\n"


def _describe(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return done.stdout.strip()[:80] or "not a git checkout"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
