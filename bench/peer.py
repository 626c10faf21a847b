"""`tessera bench peer`: tessera's decoder against llama.cpp's `llama-server` on P1, same weights.

Needs env LLAMA_SERVER, the path of a `llama-server` binary (the README's "Comparing with
llama.cpp" builds one offline); without it this prints how to build one and exits 0. In one run:
  1. `tessera models export-gguf` writes the checkpoint as GGUF at each precision (F32, BF16);
  2. per precision, `llama-server` (32 slots, continuous batching, one context of 32 x 1024
     tokens) and `python -m services.decoder --dtype` (float32 / bfloat16) start side by side;
  3. both answer a few short greedy prompts; their token ids must be identical (reported);
  4. P1 (bench/decode.py's workload: 32 concurrent requests, prompts 16-512 tokens, outputs
     16-256, EOS ignored, greedy) runs against each, interleaved, for `--rounds` rounds, each
     round on new token ids so neither prefix cache hits; tokens/s is generated tokens over wall.
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
from decode import _grpc_run, fresh_tokens, workload

DTYPE_BY_OUTTYPE = {"f32": "float32", "bf16": "bfloat16"}
CHECK_PROMPTS = [[504, 3575, 282, 4649, 314], [1350, 253, 1345, 30, 378, 1019, 7042], list(range(1000, 1040))]
CHECK_TOKENS = 16
BUILD_HELP = """LLAMA_SERVER is not set: nothing to compare against. Build llama.cpp's server offline from the
llama-cpp-python sdist's vendored source (see the README, "Comparing with llama.cpp"):

  pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llama && cd /tmp/llama
  tar xzf llama_cpp_python-*.tar.gz && cd llama_cpp_python-*/vendor/llama.cpp
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \\
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  nice -n 10 cmake --build build --target llama-server -j2

then: LLAMA_SERVER=$PWD/build/bin/llama-server tessera bench peer"""


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
        decoder, address = start_decoder(args.model_dir, flags, RESULTS / f"peer-tessera-{outtype}.log")
        try:
            agree = [tessera_greedy(address, p, CHECK_TOKENS) == llama_complete(url, p, CHECK_TOKENS)
                     for p in CHECK_PROMPTS]
            tessera_rates, llama_rates = [], []
            for round_index in range(args.rounds):
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
    return {"outtype": outtype, "agree": agree, "tessera": tessera_rates, "llama": llama_rates}


def report(results: list[dict], args) -> str:
    lines = ["| precision | server | P1 tok/s per round | median | tessera / llama.cpp | greedy ids identical |",
             "|---|---|---|---|---|---|"]
    for r in results:
        t, ll = statistics.median(r["tessera"]), statistics.median(r["llama"])
        same = f"{sum(r['agree'])}/{len(r['agree'])} prompts"
        lines.append(f"| {r['outtype'].upper()} | tessera (`--dtype {DTYPE_BY_OUTTYPE[r['outtype']]}`) | "
                     f"{', '.join(f'{x:.1f}' for x in r['tessera'])} | {t:.1f} | {t / ll:.2f}x | {same} |")
        lines.append(f"| {r['outtype'].upper()} | llama-server ({args.slots} slots) | "
                     f"{', '.join(f'{x:.1f}' for x in r['llama'])} | {ll:.1f} | | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tessera.cli.gguf_export import default_output, export_gguf
    from tessera.paths import default_decoder_dir

    parser = argparse.ArgumentParser(prog="tessera bench peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=default_decoder_dir())
    parser.add_argument("--outtypes", nargs="+", choices=sorted(DTYPE_BY_OUTTYPE), default=["f32", "bf16"])
    parser.add_argument("--rounds", type=int, default=2)
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
        f"greedy; prefix caching off on both; interleaved, {args.rounds} rounds (median). Target: "
        f"tessera >= 1.5x llama-server at each precision.\n\n{table}\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
