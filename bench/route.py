"""`tessera bench route`: decoder replicas behind the gateway's router.

--simulate: replays a synthetic trace (multi-turn conversations sharing system prompts, Zipf-popular
  adapters, bursty arrivals; bench/_route_sim.py) through the gateway's own router code
  (services/gateway/routing/cache_aware.py) over 2..64 simulated replicas, beside round robin and consistent
  hashing of the first block, and reports prefix-hit rate, adapter swaps, queue imbalance and
  latency.
real (default): two decoder replicas, one compute thread each, pinned to different cores, behind a
  real gateway, serve distinct prompts; the anchor is one such replica behind the same gateway.
  Reports aggregate generated tokens/s and the speed-up (target >= 1.6x on 2 cores).

Both rewrite their part of bench/results/route.md. Never a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _decoder_proc import RESULTS, machine

RESULT_FILE = RESULTS / "route.md"
POLICIES = ("router", "round_robin", "consistent_hash")


def run_simulation(args) -> str:
    from _route_sim import SimConfig, simulate

    lines = ["## simulated (`tessera bench route --simulate`)", "",
             f"{args.conversations} conversations per replica, 2-6 turns, 6 shared system prompts, 24 adapters "
             f"(Zipf s=1.1, 30% base model), {args.adapter_slots} adapter slots and {args.kv_blocks} KV blocks "
             f"(64 bytes ~ 16 tokens each) per replica, prefill {args.prefill_ms} ms/token, decode "
             f"{args.decode_ms} ms/token (SmolLM2-135M on this machine: bench/results/prefix.md, decode.md), "
             "adapter swap 0.3 s, bursts of 1-6 conversations, ~70% offered load; each replica serves one "
             "request at a time, first come first served (no batching: queueing costs more than on a real "
             "decoder, so this is a pessimistic setting for affinity).", "",
             "| replicas | policy | requests | prefix-hit rate | adapter swaps | queue imbalance | "
             "mean latency s | p95 latency s |", "|---|---|---|---|---|---|---|---|"]
    for n in args.replicas:
        cfg = SimConfig(num_replicas=n, conversations_per_replica=args.conversations,
                        adapter_slots=args.adapter_slots, kv_blocks=args.kv_blocks, seed=args.seed,
                        prefill_s=args.prefill_ms / 1000, decode_s=args.decode_ms / 1000)
        for policy in POLICIES:
            start = time.perf_counter()
            r = simulate(cfg, policy)
            lines.append(f"| {n} | {r.policy} | {r.num_requests} | {r.prefix_hit_rate:.2f} | {r.adapter_swaps} | "
                         f"{r.queue_imbalance:.2f} | {r.mean_latency_s:.2f} | {r.p95_latency_s:.2f} |")
            print(lines[-1], f"({time.perf_counter() - start:.1f} s)", flush=True)
    lines += ["", "queue imbalance: mean over arrivals of (longest - shortest) replica queue, in requests."]
    return "\n".join(lines)


def _pin(pid: int, core: int) -> None:
    """Pin every thread of `pid` to `core` (threads started later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {core})


def _start(module: str, args: list[str], log_dir: Path, name: str, threads: int = 1):
    from services.common.launch import ServiceProcess

    return ServiceProcess(module, args, env={"OMP_NUM_THREADS": str(threads)}, startup_s=600,
                          log_path=log_dir / f"{name}.log").start()


async def _load(address: str, num_streams: int, max_tokens: int, rounds: int) -> tuple[float, set[str]]:
    """Generated tokens per second with `num_streams` distinct prompts in flight, best of `rounds`."""
    import grpc

    from services.gateway.servicer import REPLICA_METADATA
    from tessera.v1 import decoder_pb2, gateway_pb2_grpc

    async def one(stub, i: int, r: int) -> tuple[int, str]:
        request = decoder_pb2.GenerateRequest(
            prompt=[decoder_pb2.ContentPart(text=f"Round {r}, story {i}: once upon a time in city {i * 31 + r},")],
            sampling=decoder_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        call = stub.Generate(request, timeout=600)
        count = 0
        async for response in call:
            count += len(response.token_ids)
        return count, dict(await call.initial_metadata())[REPLICA_METADATA]

    best, replicas = 0.0, set()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await one(stub, -1, -1)  # warm-up
        for r in range(rounds):
            start = time.perf_counter()
            results = await asyncio.gather(*(one(stub, i, r) for i in range(num_streams)))
            best = max(best, sum(c for c, _ in results) / (time.perf_counter() - start))
            replicas |= {a for _, a in results}
    return best, replicas


def _through_gateway(targets: str, args, log_dir: Path, label: str) -> tuple[float, set[str]]:
    gateway = _start("services.gateway", ["--decoder", targets, "--pooling", targets.split(",")[-1],
                                          "--adapters", targets.split(",")[-1], "--vision", ""],
                     log_dir, f"gateway-{label.replace(' ', '-')}")
    try:
        result = asyncio.run(_load(gateway.address, args.streams, args.max_tokens, args.rounds))
    finally:
        gateway.stop()
    print(f"{label}: {result[0]:.1f} tok/s over {len(result[1])} replica(s)", flush=True)
    return result


def run_real(args) -> str:
    import tempfile

    from tessera.paths import default_decoder_dir

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("bench route needs two cores to pin two replicas")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-route-"))
    per_replica = max(1, args.streams // 2)
    load_start = os.getloadavg()[0]

    def decoder(name: str, max_num_seqs: int, core: int):
        service = _start("services.decoder", ["--model-dir", str(default_decoder_dir()), "--max-num-seqs",
                                              str(max_num_seqs), "--max-model-len", "1024"], log_dir, name)
        _pin(service.process.pid, core)
        return service

    results, started = {}, []
    try:
        started += [decoder(f"decoder-{i}", per_replica, core) for i, core in enumerate(cores[:2])]
        a, b = (d.address for d in started)
        results["one"] = _through_gateway(a, args, log_dir, "one replica")
        results["two"] = _through_gateway(f"ipv4:{a},{b}", args, log_dir, "two replicas")
        for service in started:
            service.stop()
        started = [decoder("decoder-wide", args.streams, cores[0])]
        results["wide"] = _through_gateway(started[0].address, args, log_dir, "one replica, whole batch")
    finally:
        for service in started:
            service.stop()
    one, two, wide = (results[k][0] for k in ("one", "two", "wide"))
    return "\n".join([
        "## real (`tessera bench route`)", "",
        f"machine: {machine()}. This machine has {os.cpu_count()} cores, shared with other work while "
        "measuring; each replica is one decoder process with one compute thread (OMP_NUM_THREADS=1), all its "
        f"threads pinned to its own core ({cores[0]} and {cores[1]}); the gateway and client are not pinned.",
        f"Workload: {args.streams} streams in flight, distinct prompts, {args.max_tokens} tokens each "
        f"(ignore_eos), best of {args.rounds} rounds, through the gateway. Each replica runs at most "
        f"{per_replica} sequences at a time (`--max-num-seqs {per_replica}`, its capacity here), so one "
        "replica queues what two run at once.", "",
        "| setup | generated tok/s | replicas used |", "|---|---|---|",
        f"| one replica (anchor) | {one:.1f} | {len(results['one'][1])} |",
        f"| two replicas | {two:.1f} | {len(results['two'][1])} |",
        f"| one replica allowed all {args.streams} sequences in one batch | {wide:.1f} | 1 |", "",
        f"speed-up, two replicas / one: {two / one:.2f}x (target >= 1.6x); two replicas / one replica "
        f"batching everything: {two / wide:.2f}x (a bigger batch makes each decode step cheaper per token, "
        "so one replica given the whole batch narrows the gap). Load average (other users' work on the same "
        f"cores) at the start and end: {load_start:.1f} and {os.getloadavg()[0]:.1f}."])


def _write(section: str, heading: str) -> None:
    """Replace the `heading` section of the results file (keep the other one)."""
    text = RESULT_FILE.read_text() if RESULT_FILE.exists() else "# bench route\n"
    pattern = re.compile(rf"^{re.escape(heading)}.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(section.rstrip() + "\n\n", text) if pattern.search(text) else \
        text.rstrip() + "\n\n" + section.rstrip() + "\n"
    RESULT_FILE.write_text(text.rstrip() + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera bench route", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulate", action="store_true", help="simulated replicas instead of real decoders")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--conversations", type=int, default=10, help="simulated conversations per replica")
    parser.add_argument("--adapter-slots", type=int, default=4)
    parser.add_argument("--kv-blocks", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-ms", type=float, default=1.7, help="simulated prefill time per uncached token")
    parser.add_argument("--decode-ms", type=float, default=12.0, help="simulated decode time per output token")
    parser.add_argument("--streams", type=int, default=8, help="real: streams in flight")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.simulate:
        if any(not 1 <= n <= 256 for n in args.replicas):
            parser.error(f"--replicas must be in 1..256, got {args.replicas}")
        _write(run_simulation(args), "## simulated")
    else:
        _write(run_real(args), "## real")
    print(f"wrote {RESULT_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
