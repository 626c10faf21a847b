"""`python bench/http_chat.py [--before DIR]`: HTTP chat latency through the gateway.

Starts `tessera up --http-port` (no vision) from this checkout, and with `--before DIR` a second
cluster from the checkout DIR (cwd and PYTHONPATH = DIR), on other ports; then sends `--requests`
short chats one at a time (max_tokens cycling 1..4, temperature 0) to each HTTP API, in blocks that
alternate between the two, so both see the same machine and noise. Reports p50 and p90 latency per
cluster and the host (CPU model and features). Writes bench/results/http_chat.md. Never a test
assertion.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _decoder_proc import REPO, RESULTS, machine

BLOCK = 20  # chats per turn before the other cluster's


_TAKEN: set[int] = set()  # ranges handed out already (the clusters bind them only once started)


def _free_ports(count: int) -> int:
    """The first of `count` consecutive free ports, in a range not handed out before."""
    for base in range(21000 + os.getpid() % 3000 * 10, 60000, 10):
        if base in _TAKEN:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            _TAKEN.add(base)
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


class Cluster:
    """`tessera up` of one checkout, its HTTP API at `url`."""

    def __init__(self, checkout: Path, tag: str, log_dir: Path):
        self.checkout, self.tag = checkout, tag
        base = _free_ports(6)
        self.http_port = base + 5
        self.url = f"127.0.0.1:{self.http_port}"
        self.name = f"bench-http-{tag}-{os.getpid()}"
        self.log = log_dir / f"http_chat-{tag}.log"
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tessera.cli.main", "up", "--base-port", str(base), "--http-port",
                 str(self.http_port), "--no-vision", "--cluster", self.name],
                cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.tag}: tessera up exited; see {self.log}")
            try:
                connection = http.client.HTTPConnection(self.url, timeout=5)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.tag}: /health not 200 after {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        from tessera.paths import cluster_home

        shutil.rmtree(cluster_home(self.name), ignore_errors=True)


def _model(connection: http.client.HTTPConnection) -> str:
    connection.request("GET", "/v1/models")
    return json.loads(connection.getresponse().read())["data"][0]["id"]


def _chats(connection: http.client.HTTPConnection, model: str, first: int, count: int) -> list[float]:
    """Seconds per chat, one at a time on one keep-alive connection, opened afresh by an untimed
    chat first (the server closes a connection idle for 5 s, uvicorn's keep-alive)."""
    connection.close()
    out = []
    for i in range(first - 1, first + count):
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": f"Say a word ({i})."}],
                           "max_tokens": 1 + i % 4, "temperature": 0})
        start = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        data = reply.read()
        if i >= first:
            out.append(time.perf_counter() - start)
        if reply.status != 200:
            raise RuntimeError(f"chat answered {reply.status}: {data[:200]!r}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="a checkout to compare with (e.g. a `git worktree` of main)")
    parser.add_argument("--requests", type=int, default=200, help="chats per cluster")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    checkouts = {"after": REPO, **({"before": args.before.resolve()} if args.before else {})}
    clusters = {tag: Cluster(path, tag, RESULTS) for tag, path in checkouts.items()}
    latencies: dict[str, list[float]] = {tag: [] for tag in clusters}
    try:
        for cluster in clusters.values():
            cluster.wait()
        connections = {tag: http.client.HTTPConnection(c.url, timeout=300) for tag, c in clusters.items()}
        models = {tag: _model(connection) for tag, connection in connections.items()}
        for tag, connection in connections.items():  # warm-up: first requests compile and fill caches
            _chats(connection, models[tag], 10_000, 10)
        order = list(clusters)
        for first in range(0, args.requests, BLOCK):
            for tag in order:
                latencies[tag] += _chats(connections[tag], models[tag], first, min(BLOCK, args.requests - first))
            order.reverse()  # who goes first alternates per block
    finally:
        for cluster in clusters.values():
            cluster.stop()
    lines = ["# HTTP chat latency (`python bench/http_chat.py --before DIR`)", "", f"machine: {machine()}", "",
             f"{args.requests} short chats per cluster, one at a time (max_tokens 1-4, temperature 0, no vision), "
             f"in alternating blocks of {BLOCK}; latency = request sent to answer read.", "",
             "| cluster | checkout | p50 ms | p90 ms | mean ms | p50 ms, max_tokens 1 |", "|---|---|---|---|---|---|"]
    for tag, values in latencies.items():
        ms = sorted(v * 1000 for v in values)
        one = [v * 1000 for i, v in enumerate(values) if i % 4 == 0]  # chat i asks 1 + i % 4 tokens
        lines.append(f"| {tag} | {checkouts[tag].name} | {statistics.median(ms):.1f} | "
                     f"{ms[int(0.9 * (len(ms) - 1))]:.1f} | {statistics.fmean(ms):.1f} | {statistics.median(one):.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "http_chat.md").write_text(text)


if __name__ == "__main__":
    main()
