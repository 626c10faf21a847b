"""`tessera bench peer`: tessera's decoder against llama.cpp's `llama-server` on P1 and at batch 1, same weights.

Needs env LLAMA_SERVER, the path of a `llama-server` binary (the README's "Comparing with
llama.cpp" builds one offline); without it this prints how to build one and exits 0. In one run:
  1. `tessera models export-gguf` writes the checkpoint as GGUF at each precision (F32, BF16, Q8_0,
     Q4_0: `--outtypes`);
  2. per precision, `llama-server` (32 slots, continuous batching, one context of 32 x 1024
     tokens) and `python -m services.decoder --dtype` (float32 / bfloat16) start side by side; for
     Q8_0 and Q4_0 tessera serves the same file's blocks (`models import --keep-quantized`, float32
     activations, `--quant-mode`: fast by default, int8 activations as llama.cpp computes);
  3. both answer a few short greedy prompts; their token ids must be identical (reported);
  4. P1 (bench/decode.py's workload: 32 concurrent requests, prompts 16-512 tokens, outputs
     16-256, EOS ignored, greedy) runs against each, interleaved, for `--rounds` rounds, each
     round on new token ids so neither prefix cache hits; tokens/s is generated tokens over wall;
  5. batch 1 (`--modes batch1`): one request at a time, prompt 128 tokens, 128 generated, greedy,
     EOS ignored, `--batch1-requests` per server per round, interleaved as P1. Per request, streamed:
     the time to the first token (TTFT: the 128-token prompt), tok/s of the whole request (128 over
     its wall time) and decode-only tok/s (the 127 tokens after the first over their time). Beside
     them, the batch-1 roofline: the bytes of weights each token reads (every projection and the
     lm_head at the precision) over the read bandwidth measured in the same run (bench/_flops.py):
     probed before and after each server's batch-1 run, each run's decode set against the mean of
     its two probes, the median of those ratios reported (a shared VM's bandwidth moves by tens of
     percent between minutes: one probe at the start of the run misstated it by up to 1.7x).
Prefix caching is off on both sides (tessera `--no-prefix-caching`, llama.cpp
`cache_prompt: false`). Writes bench/results/peer.md. Never a test assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _decoder_proc import RESULTS, machine, start_decoder, stop
from _flops import ModelShape, read_bandwidth
from decode import _grpc_run, fresh_tokens, workload

DTYPE_BY_OUTTYPE = {"f32": "float32", "bf16": "bfloat16", "q8_0": "float32", "q4_0": "float32"}
BYTES_BY_OUTTYPE = {"f32": 4, "bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}  # bytes per weight (ggml blocks)
QUANTIZED = ("q8_0", "q4_0")
MODES = ("p1", "batch1")
BATCH1_PROMPT, BATCH1_TOKENS = 128, 128
CHECK_PROMPTS = [[504, 3575, 282, 4649, 314], [1350, 253, 1345, 30, 378, 1019, 7042], list(range(1000, 1040))]
CHECK_TOKENS = 16
BUILD_HELP = """LLAMA_SERVER is not set: nothing to compare against. Build llama.cpp's server offline from the
llama-cpp-python sdist's vendored source (see the README, "Comparing with llama.cpp"):

  pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llama && cd /tmp/llama
  tar xzf llama_cpp_python-*.tar.gz && cd llama_cpp_python-*/vendor/llama.cpp
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \\
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  nice -n 10 cmake --build build --target llama-server -j2

then: LLAMA_SERVER=$PWD/build/bin/llama-server tessera bench peer
(a VM that reports AMX without granting its tile state: see the README for the flags without AMX)"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_llama(binary: str, gguf_path: Path, slots: int, slot_ctx: int, log_path: Path):
    """`llama-server` on a free loopback port; returns (process, base URL) once /health answers 200."""
    port = _free_port()
    command = [binary, "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
               "-c", str(slots * slot_ctx), "-cb", "-t", str(os.cpu_count() or 1), "--no-warmup"]
    log = log_path.open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(1)
    stop(process)
    raise RuntimeError(f"llama-server did not become healthy in 300 s; see {log_path}")


def llama_complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One greedy /completion (EOS ignored, no prompt cache); the generated token ids."""
    body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "cache_prompt": False, "return_tokens": True, "stream": False}
    request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())["tokens"]


def llama_run(url: str, work) -> float:
    """P1 against llama-server: every request at once (one thread each); generated tokens/s."""
    llama_complete(url, work[0][0][:8], 2)  # warm-up
    with ThreadPoolExecutor(max_workers=len(work)) as pool:
        start = time.perf_counter()
        counts = list(pool.map(lambda item: len(llama_complete(url, *item)), work))
        wall = time.perf_counter() - start
    return sum(counts) / wall


def llama_stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """One streamed greedy /completion (EOS ignored, no prompt cache): (seconds to the first token,
    seconds in all, tokens)."""
    body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "cache_prompt": False, "stream": True}
    request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start, first, tokens = time.perf_counter(), None, 0
    with urllib.request.urlopen(request, timeout=3600) as response:
        for line in response:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("content") or event.get("tokens"):
                tokens += max(1, len(event.get("tokens") or ()))
                first = first or time.perf_counter()
            if event.get("stop"):
                break
    return first - start, time.perf_counter() - start, tokens


def tessera_stream(address: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """One streamed greedy Generate over gRPC (EOS ignored): as `llama_stream`."""
    import asyncio

    import grpc

    from tessera.v1 import decoder_pb2, decoder_pb2_grpc

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderStub(channel)
            request = decoder_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=decoder_pb2.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True))
            start, first, tokens = time.perf_counter(), None, 0
            async for response in stub.Generate(request, timeout=600):
                if response.token_ids:
                    tokens += len(response.token_ids)
                    first = first or time.perf_counter()
            return first - start, time.perf_counter() - start, tokens

    return asyncio.run(run())


def batch1_round(stream, seed: int, requests: int) -> list[dict]:
    """`requests` requests one after another through `stream` (after an untimed one): per request
    TTFT (ms), whole-request tok/s and decode-only tok/s."""
    import random

    rng = random.Random(seed)
    stream([rng.randrange(100, 40000) for _ in range(16)], 4)
    out = []
    for _ in range(requests):
        ttft, total, tokens = stream([rng.randrange(100, 40000) for _ in range(BATCH1_PROMPT)], BATCH1_TOKENS)
        out.append({"ttft_ms": 1000 * ttft, "request": tokens / total,
                    "decode": (tokens - 1) / (total - ttft) if tokens > 1 else 0.0})
    return out


def tessera_greedy(address: str, prompt: list[int], max_tokens: int) -> list[int]:
    import asyncio

    import grpc

    from tessera.v1 import decoder_pb2, decoder_pb2_grpc

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderStub(channel)
            request = decoder_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=decoder_pb2.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True))
            return [t async for r in stub.Generate(request, timeout=600) for t in r.token_ids]

    return asyncio.run(run())


def compare_precision(args, outtype: str, gguf_path: Path, work) -> dict:
    """Start both servers at one precision, check greedy agreement, run P1 interleaved."""
    import asyncio

    llama, url = start_llama(args.llama_server, gguf_path, args.slots, args.slot_ctx,
                             RESULTS / f"peer-llama-{outtype}.log")
    try:
        flags = ["--dtype", DTYPE_BY_OUTTYPE[outtype], "--no-prefix-caching", *args.decoder_flags.split()]
        model_dir = args.model_dir
        if outtype in QUANTIZED:  # the same file's blocks, imported once
            from tessera.cli.models import serve_gguf

            model_dir = serve_gguf(gguf_path)
            flags += ["--quant-mode", args.quant_mode]
        decoder, address = start_decoder(model_dir, flags, RESULTS / f"peer-tessera-{outtype}.log")
        try:
            agree = [tessera_greedy(address, p, CHECK_TOKENS) == llama_complete(url, p, CHECK_TOKENS)
                     for p in CHECK_PROMPTS]
            tessera_rates, llama_rates, batch1, probes = [], [], {"tessera": [], "llama": []}, []
            streams = {"tessera": lambda p, n: tessera_stream(address, p, n), "llama": lambda p, n: llama_stream(url, p, n)}
            for round_index in range(args.rounds if "batch1" in args.modes else 0):
                for name in ("tessera", "llama") if round_index % 2 == 0 else ("llama", "tessera"):
                    before = probes[-1] if probes else read_bandwidth()  # GB/s, both servers idle
                    # the same prompts for both servers in a round, new ones each round (no cache hit)
                    rows = batch1_round(streams[name], 200 + round_index, args.batch1_requests)
                    probes += [before, read_bandwidth()] if not probes else [read_bandwidth()]
                    for row in rows:
                        row["bandwidth"] = (before + probes[-1]) / 2
                    batch1[name] += rows
                    print(f"[peer] {outtype} batch-1 round {round_index + 1}: {name} "
                          f"{statistics.median(r['request'] for r in rows):.1f} tok/s per request, decode "
                          f"{statistics.median(r['decode'] for r in rows):.1f} tok/s, TTFT "
                          f"{statistics.median(r['ttft_ms'] for r in rows):.0f} ms; read bandwidth "
                          f"{before:.1f} GB/s before, {probes[-1]:.1f} after", flush=True)
            for round_index in range(args.rounds if "p1" in args.modes else 0):
                round_work = fresh_tokens(work, seed=100 + round_index)
                runs = [("tessera", lambda w=round_work: asyncio.run(_grpc_run(address, w))),
                        ("llama", lambda w=round_work: llama_run(url, w))]
                for name, run in runs if round_index % 2 == 0 else runs[::-1]:  # alternate who goes first
                    rate = run()
                    (tessera_rates if name == "tessera" else llama_rates).append(rate)
                    print(f"[peer] {outtype} round {round_index + 1}: {name} {rate:.1f} tok/s", flush=True)
        finally:
            stop(decoder)
    finally:
        stop(llama)
    return {"outtype": outtype, "agree": agree, "tessera": tessera_rates, "llama": llama_rates, "batch1": batch1,
            "bandwidth": probes}


def report(results: list[dict], args) -> str:
    sections = []
    if "p1" in args.modes:
        lines = ["| precision | server | P1 tok/s per round | median | tessera / llama.cpp | greedy ids identical |",
                 "|---|---|---|---|---|---|"]
        for r in results:
            t, ll = statistics.median(r["tessera"]), statistics.median(r["llama"])
            same = f"{sum(r['agree'])}/{len(r['agree'])} prompts"
            lines.append(f"| {r['outtype'].upper()} | tessera (`{_flags(r['outtype'], args)}`) | "
                         f"{', '.join(f'{x:.1f}' for x in r['tessera'])} | {t:.1f} | {t / ll:.2f}x | {same} |")
            lines.append(f"| {r['outtype'].upper()} | llama-server ({args.slots} slots) | "
                         f"{', '.join(f'{x:.1f}' for x in r['llama'])} | {ll:.1f} | | {same} |")
        sections.append("\n".join(lines))
    if "batch1" in args.modes:
        lines = [f"Batch 1: one request at a time, prompt {BATCH1_PROMPT} tokens, {BATCH1_TOKENS} generated, greedy, "
                 f"EOS ignored; {args.batch1_requests} requests per server per round, {args.rounds} rounds "
                 f"interleaved; medians over all requests. Roofline: weight bytes per token "
                 f"({args.weight_mb:.0f} MB at F32) over the read bandwidth probed before and after each "
                 f"server's run, each request's decode against the mean of its run's two probes, the median "
                 f"ratio and roofline shown (probes in order, GB/s: "
                 + "; ".join(f"{r['outtype'].upper()} " + ", ".join(f"{b:.1f}" for b in r["bandwidth"])
                             for r in results) + ").", "",
                 "| precision | server | tok/s per request | decode tok/s | TTFT ms | tessera / llama.cpp (request, decode) "
                 "| decode / roofline |", "|---|---|---|---|---|---|---|"]
        for r in results:
            med = {name: {key: statistics.median(row[key] for row in rows) for key in ("request", "decode", "ttft_ms")}
                   for name, rows in r["batch1"].items()}
            token_bytes = args.weight_mb * 1e6 * BYTES_BY_OUTTYPE[r["outtype"]] / 4
            share = {name: statistics.median(row["decode"] / (row["bandwidth"] * 1e9 / token_bytes) for row in rows)
                     for name, rows in r["batch1"].items()}
            roofline = statistics.median(row["bandwidth"] for row in r["batch1"]["tessera"]) * 1e9 / token_bytes
            t, ll = med["tessera"], med["llama"]
            lines.append(f"| {r['outtype'].upper()} | tessera ({_flags(r['outtype'], args)}) | {t['request']:.1f} | {t['decode']:.1f} | "
                         f"{t['ttft_ms']:.0f} | {t['request'] / ll['request']:.2f}x, {t['decode'] / ll['decode']:.2f}x | "
                         f"{share['tessera']:.2f} (roofline {roofline:.1f} tok/s) |")
            lines.append(f"| {r['outtype'].upper()} | llama-server | {ll['request']:.1f} | {ll['decode']:.1f} | "
                         f"{ll['ttft_ms']:.0f} | | {share['llama']:.2f} |")
        sections.append("\n".join(lines))
    return "\n\n".join(sections)


def _flags(outtype: str, args) -> str:
    if outtype in QUANTIZED:
        return f"GGUF blocks, --quant-mode {args.quant_mode}"
    return f"--dtype {DTYPE_BY_OUTTYPE[outtype]}"


def main(argv: list[str] | None = None) -> int:
    from tessera.cli.gguf_export import default_output, export_gguf
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--outtypes", nargs="+", choices=sorted(DTYPE_BY_OUTTYPE), default=["f32", "bf16", "q8_0", "q4_0"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quant-mode", choices=("exact", "fast"), default="fast",
                        help="tessera's --quant-mode for the Q8_0 / Q4_0 files (fast: int8 activations, as llama.cpp)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="p1: 32 concurrent requests; batch1: one request at a time")
    parser.add_argument("--batch1-requests", type=int, default=3, help="batch-1 requests per server per round")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(16, 512))
    parser.add_argument("--tokens-range", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--slots", type=int, default=32, help="llama-server parallel slots")
    parser.add_argument("--slot-ctx", type=int, default=1024, help="llama-server context per slot (tokens)")
    parser.add_argument("--decoder-flags", default="", help="extra flags for python -m services.decoder")
    parser.add_argument("--output", type=Path, default=RESULTS / "peer.md")
    args = parser.parse_args(argv)
    args.llama_server = os.environ.get("LLAMA_SERVER", "")
    if not args.llama_server:
        print(BUILD_HELP)
        return 0
    work = workload(args.num_requests, tuple(args.prompt_range), tuple(args.tokens_range))
    shape = ModelShape.read(args.model_dir)
    args.weight_mb = 4 * (shape.linear_params + shape.hidden * shape.vocab) / 1e6  # float32 bytes per token
    args.bandwidth = read_bandwidth()
    print(f"[peer] read bandwidth {args.bandwidth:.1f} GB/s; weights read per token {args.weight_mb:.0f} MB at F32",
          flush=True)
    results = []
    for outtype in args.outtypes:
        gguf_path = default_output(args.model_dir, outtype)
        newest_weights = max(f.stat().st_mtime for f in args.model_dir.glob("*.safetensors"))
        if not gguf_path.exists() or gguf_path.stat().st_mtime < newest_weights:
            print(f"[peer] exporting {gguf_path}", flush=True)
            export_gguf(args.model_dir, gguf_path, outtype)
        results.append(compare_precision(args, outtype, gguf_path, work))
    table = report(results, args)
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        f"# tessera bench peer\n\nMachine: {machine()}\n\nModel: {args.model_dir.name}; llama-server: "
        f"{args.llama_server}; P1 = {args.num_requests} concurrent requests, prompts {args.prompt_range[0]}-"
        f"{args.prompt_range[1]} tokens, outputs {args.tokens_range[0]}-{args.tokens_range[1]}, EOS ignored, "
        f"greedy; prefix caching off on both; interleaved, {args.rounds} rounds (median). Targets: "
        f"P1 tessera >= 1.5x llama-server at each precision; batch 1 >= 1.0x, decode >= 0.8 of the roofline "
        f"(F32, BF16).\n\n"
        f"{table}\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
