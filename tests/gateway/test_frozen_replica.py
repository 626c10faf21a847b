"""A decoder replica that stops answering while its TCP connection stays open (SIGSTOP, a wedged
process) is dropped by the gateway within seconds, as a killed one is: its stream ends UNAVAILABLE
naming it, new requests go to the other replica, GetInfo lists it not ready; after SIGCONT it
serves again. Real processes on loopback: two stub decoders (tests/gateway/stub_decoder.py) behind
`python -m services.gateway`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import requests

from services.common.auth import INTERNAL_TOKEN_FILE_ENV
from services.common.server import CHANNEL_OPTIONS, KEEPALIVE_TIME_MS, PING_TIMEOUT_MS
from services.gateway.servicer import REPLICA_METADATA
from tessera.v1 import decoder_pb2, gateway_pb2, gateway_pb2_grpc

from .stub_decoder import TOKEN_INTERVAL_S

REPO = Path(__file__).resolve().parents[2]
PORT_RANGE = range(22000, 23000)
NUM_PORTS = 4  # gateway, two decoders, the gateway's HTTP (pooling, adapters: nothing listens; vision: off)
DETECT_S = (KEEPALIVE_TIME_MS + PING_TIMEOUT_MS) / 1000 + 4  # a stopped replica is out of rotation by then
STREAM_TOKENS = int(40 / TOKEN_INTERVAL_S)  # a stream that would run 40 s if nothing broke it


def _free_ports() -> list[int]:
    """NUM_PORTS consecutive free loopback ports in PORT_RANGE."""
    span = len(PORT_RANGE) - NUM_PORTS
    for attempt in range(100):
        base = PORT_RANGE.start + (os.getpid() * 31 + attempt * 7 + int(time.time())) % span
        sockets = []
        try:
            for port in range(base, base + NUM_PORTS):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return list(range(base, base + NUM_PORTS))
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {NUM_PORTS} free ports in {PORT_RANGE}")


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != INTERNAL_TOKEN_FILE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def _until(predicate: Callable[[], object], timeout_s: float, what: str) -> float:
    """Seconds until `predicate()` is true; fails naming `what` after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - start


def _request(num_tokens: int) -> decoder_pb2.GenerateRequest:
    return decoder_pb2.GenerateRequest(request_id=uuid.uuid4().hex,
                                       prompt=[decoder_pb2.ContentPart(text="Tell me about lighthouses.")],
                                       sampling=decoder_pb2.SamplingParams(max_tokens=num_tokens))


def _generate(stub, num_tokens: int = 3, timeout_s: float = 10.0) -> tuple[str, int]:
    """(replica that served it, tokens streamed) of one Generate through the gateway."""
    call = stub.Generate(_request(num_tokens), timeout=timeout_s)
    num_streamed = sum(len(response.token_ids) for response in call)
    return dict(call.initial_metadata())[REPLICA_METADATA], num_streamed


def _replicas(stub) -> dict[str, gateway_pb2.ReplicaInfo]:
    info = stub.GetInfo(gateway_pb2.ClusterInfoRequest(), timeout=10)
    return {r.address: r for r in info.replicas if r.service == "decoder"}


@pytest.fixture
def cluster(tmp_path):
    """(gateway stub, {decoder address: its process}, HTTP url); every process stopped afterwards."""
    gateway_port, http_port, *decoder_ports = _free_ports()
    decoders = {f"127.0.0.1:{port}": _start(["-m", "tests.gateway.stub_decoder", f"127.0.0.1:{port}"],
                                            tmp_path / f"decoder-{port}.log") for port in decoder_ports}
    target = "ipv4:" + ",".join(decoders)
    gateway = _start(["-m", "services.gateway", "--address", f"127.0.0.1:{gateway_port}", "--decoder", target,
                      "--pooling", "127.0.0.1:1", "--adapters", "127.0.0.1:1", "--vision", "",
                      "--http-port", str(http_port)],
                     tmp_path / "gateway.log")
    processes = [gateway, *decoders.values()]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gateway_port}", options=CHANNEL_OPTIONS) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = gateway_pb2_grpc.GatewayStub(channel)
            _until(lambda: [r.ready for r in _replicas(stub).values()] == [True, True], 30,
                   "both stub decoders ready behind the gateway")
            yield stub, decoders, f"http://127.0.0.1:{http_port}"
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a stopped process acts on SIGKILL only once continued
                process.kill()
            process.wait(10)


def _generate_in_background(stub, num_calls: int) -> tuple[list[threading.Thread], list[tuple]]:
    """`num_calls` concurrent Generates; each appends (replica, tokens, end time) or (error, end time)."""
    results: list[tuple] = []

    def one() -> None:
        try:
            results.append((*_generate(stub, timeout_s=30), time.monotonic()))
        except grpc.RpcError as error:
            results.append((error, time.monotonic()))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(num_calls)]
    for thread in threads:
        thread.start()
    return threads, results


def _check_served_elsewhere(threads: list[threading.Thread], results: list[tuple], victim_address: str,
                            stopped_at: float) -> None:
    """Every request sent just after the stop succeeded on the other replica within DETECT_S (one
    routed to the stopped replica before it was found out is retried there)."""
    for thread in threads:
        thread.join(DETECT_S + 5)
    assert len(results) == len(threads), f"requests sent after the stop still hang: {results}"
    for result in results:
        assert len(result) == 3, f"a request sent after the stop failed: {result[0]}"
        replica, num_tokens, ended = result
        assert replica != victim_address and num_tokens == 3 and ended - stopped_at < DETECT_S, results


def _check_back_in_rotation(stub, victim_address: str) -> None:
    _until(lambda: _replicas(stub)[victim_address].ready, 20, "the continued replica ready again")
    assert victim_address in {_generate(stub)[0] for _ in range(6)}


def test_stream_on_a_stopped_replica_ends_unavailable_and_others_move_on(cluster):
    stub, decoders, _ = cluster
    # A long stream on each replica; one of them is stopped mid-stream.
    outcomes: dict[str, dict] = {}
    streaming = threading.Event()

    def stream(key: str) -> None:
        outcome = outcomes[key] = {"replica": None, "tokens": 0, "error": None, "ended": None}
        call = stub.Generate(_request(STREAM_TOKENS), timeout=60)
        try:
            for response in call:
                if outcome["replica"] is None:
                    outcome["replica"] = dict(call.initial_metadata())[REPLICA_METADATA]
                    if sum(1 for o in outcomes.values() if o["replica"]) == 2:
                        streaming.set()
                outcome["tokens"] += len(response.token_ids)
        except grpc.RpcError as error:
            outcome["error"] = error
        outcome["ended"] = time.monotonic()

    streams = [threading.Thread(target=stream, args=(key,), daemon=True) for key in ("a", "b")]
    for thread in streams:
        thread.start()
    assert streaming.wait(10), outcomes
    assert {o["replica"] for o in outcomes.values()} == set(decoders), "not one stream per replica"
    victim_address = outcomes["a"]["replica"]
    victim = decoders[victim_address]
    victim.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        threads, results = _generate_in_background(stub, 3)
        # The stream on the stopped replica ends UNAVAILABLE naming it, long before its 60 s deadline.
        streams[0].join(DETECT_S + 5)
        stranded = outcomes["a"]
        assert stranded["ended"] is not None, "the stream on the stopped replica still hangs"
        assert stranded["ended"] - stopped_at < DETECT_S, stranded
        assert stranded["error"] is not None and stranded["error"].code() == grpc.StatusCode.UNAVAILABLE, stranded
        assert victim_address in stranded["error"].details()
        _check_served_elsewhere(threads, results, victim_address, stopped_at)
        assert not _replicas(stub)[victim_address].ready
        assert {_generate(stub)[0] for _ in range(6)} == set(decoders) - {victim_address}
        # The stream on the healthy replica never noticed: pings do not break live connections.
        assert outcomes["b"]["error"] is None and outcomes["b"]["ended"] is None, outcomes["b"]
    finally:
        victim.send_signal(signal.SIGCONT)
    _check_back_in_rotation(stub, victim_address)


def test_idle_stopped_replica_leaves_rotation_and_returns(cluster):
    """No Generate in flight there: only the health Watch, the gateway's GetInfo polls and pings.
    /health lists it as degraded (the pooler and registry are absent here: named in not_serving)."""
    stub, decoders, url = cluster
    assert {_generate(stub)[0] for _ in range(4)} == set(decoders)
    victim_address = next(iter(decoders))
    victim = decoders[victim_address]
    victim.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        threads, results = _generate_in_background(stub, 3)
        _until(lambda: not _replicas(stub)[victim_address].ready, DETECT_S, "the stopped replica not ready")
        _check_served_elsewhere(threads, results, victim_address, stopped_at)
        assert {_generate(stub)[0] for _ in range(6)} == set(decoders) - {victim_address}
        health = requests.get(f"{url}/health", timeout=30).json()
        assert [d.split(": ")[0] for d in health["degraded"]] == [f"decoder replica {victim_address}"], health
        assert not any(p.startswith("decoder") for p in health["not_serving"]), health  # the other one serves
    finally:
        victim.send_signal(signal.SIGCONT)
    _check_back_in_rotation(stub, victim_address)
    _until(lambda: requests.get(f"{url}/health", timeout=30).json()["degraded"] == [], 20, "no replica degraded")
