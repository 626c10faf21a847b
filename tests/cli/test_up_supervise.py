"""`tessera up` once the cluster is up: a process that cannot start again is retried with a backoff
of its own while the others keep serving, and endpoints.json lives only as long as the cluster.

The processes here are stand-ins (a grpc.health.v1 server on the process's address, as each
service's is), so the supervision is tested in seconds over real processes and sockets."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_testing import free_base_port, process_argvs

from services.common.healthcheck import check as check_health
from services.common.launch import REPO
from tessera.cli.endpoints import ENDPOINTS_FILE
from tessera.cli.logfiles import StartupError
from tessera.cli.up.launch import Cluster
from tessera.cli.up.spec import SERVICES, ClusterSpec
from tessera.cli.up.supervise import CrashLoopBackoff, Supervisor

# A service's stand-in: SERVING on the address it is given, or one error line and exit 1 when the
# port is taken; NOT_SERVING for ever with a second argument "never".
STAND_IN = """
import signal, sys
from concurrent.futures import ThreadPoolExecutor
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
servicer = health.HealthServicer()
server = grpc.server(ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
try:
    server.add_insecure_port(sys.argv[1])
except RuntimeError:
    sys.exit(f"RuntimeError: {sys.argv[1]} is in use")
if sys.argv[2:] == ["never"]:
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
server.start()
signal.signal(signal.SIGTERM, lambda *_: server.stop(0))
server.wait_for_termination()
"""

# `tessera up`'s own loop (run_until_signalled) over stand-ins: adapters, pooling, two decoders, gateway.
UP_WITH_STAND_INS = """
import sys
from pathlib import Path
from tessera.cli.up import run_until_signalled
from tessera.cli.up.spec import ClusterSpec
stand_in, base, home = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
ClusterSpec.command = lambda spec, name: [sys.executable, "-c", stand_in, spec.address(name)]
spec = ClusterSpec(base_port=base, num_decoders=2, vision=False, log_dir=home / "logs",
                   adapter_root=home / "adapters")
sys.exit(run_until_signalled(spec))
"""


def _pids_serving(address: str) -> list[int]:
    """Processes whose command line ends with `address` (a stand-in's)."""
    return [pid for pid, argv in process_argvs()
            if address.encode() in argv[-3:] and b"grpc_health" in b" ".join(argv)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(path: Path, pattern: str, up: subprocess.Popen, timeout_s: float) -> str:
    """The first line of `path` matching `pattern`; fails when `up` exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines():
            if re.search(pattern, line):
                return line
        if up.poll() is not None:
            break
        time.sleep(0.1)
    logs = "\n".join(p.read_text() for p in sorted(path.parent.glob("up.*")))
    pytest.fail(f"no line matching {pattern!r} (up {'exited ' + str(up.returncode) if up.poll() is not None else 'runs'}):"
                f"\n{logs}")


def _hold(port: int) -> socket.socket:
    """Listen on `port` as another program would, once the killed process has let go of it."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + 5
    while True:
        try:
            holder.bind(("127.0.0.1", port))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    holder.listen()
    return holder


def test_backoff_doubles_per_process_up_to_its_cap_and_starts_over_after_serving_a_while():
    backoff = CrashLoopBackoff(first_s=1, max_s=60, reset_s=120)
    assert [backoff.delay_s("decoder-2", served_s=0) for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff.delay_s("pooling", served_s=0) == 1  # another process's failures count for nothing here
    assert backoff.delay_s("decoder-2", served_s=119) == 60  # it served, not long enough
    assert backoff.delay_s("decoder-2", served_s=120) == 1
    assert backoff.delay_s("decoder-2", served_s=0) == 2


def test_a_replica_that_cannot_start_again_is_retried_while_the_others_keep_serving(tmp_path):
    """decoder-2 is SIGKILLed and its port taken by another program: `up` retries it after 1 s,
    2 s, ... (one line each), the gateway and the other processes keep serving, and once the port
    is free decoder-2 serves again. `up` stops only on SIGTERM, with status 0 and nothing left."""
    base = free_base_port(len(SERVICES) + 1, span=1000)
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        up = subprocess.Popen([sys.executable, "-c", UP_WITH_STAND_INS, STAND_IN, str(base), str(tmp_path)],
                              cwd=REPO, stdout=stdout, stderr=stderr, start_new_session=True)
    try:
        _wait_for(out, "^tessera is up", up, timeout_s=60)
        spec_addresses = {name: f"127.0.0.1:{base + offset}" for name, offset in
                          [("gateway", 0), ("decoder", 2), ("pooling", 3), ("adapters", 4), ("decoder-2", 5)]}
        pids = {name: _pids_serving(address) for name, address in spec_addresses.items()}
        assert all(len(found) == 1 for found in pids.values()), pids
        assert (tmp_path / "logs" / ENDPOINTS_FILE).is_file()

        os.kill(pids["decoder-2"][0], signal.SIGKILL)
        with _hold(base + 5):
            _wait_for(err, r"^decoder-2 exited unexpectedly \(code -9\); next try in 1 s, at \d\d:\d\d:\d\d$", up, 10)
            _wait_for(err, r"^decoder-2 failed to start: RuntimeError: 127\.0\.0\.1:\d+ is in use \(exited with code 1\)"
                           r"; next try in 2 s", up, 20)
            for name in ("gateway", "decoder", "pooling", "adapters"):
                assert _alive(pids[name][0]), f"{name} was stopped"
                assert check_health(spec_addresses[name]) is None, name
        _wait_for(out, r"^  decoder-2 +127\.0\.0\.1:\d+  SERVING again$", up, 20)
        assert "stopping tessera" not in out.read_text()
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    assert up.returncode == 0, err.read_text()
    assert out.read_text().splitlines()[-1] == "stopping tessera"
    assert not [pid for address in spec_addresses.values() for pid in _pids_serving(address) if _alive(pid)]
    assert not (tmp_path / "logs" / ENDPOINTS_FILE).exists()


def _stand_in_spec(tmp_path: Path, monkeypatch, argv_of=lambda name: []) -> ClusterSpec:
    """A text-only cluster of stand-ins; `argv_of(name)`: what else a process's stand-in is given."""
    monkeypatch.setattr(ClusterSpec, "command",
                        lambda spec, name: [sys.executable, "-c", STAND_IN, spec.address(name), *argv_of(name)])
    return ClusterSpec(base_port=free_base_port(len(SERVICES), span=1000), vision=False, log_dir=tmp_path / "logs",
                       adapter_root=tmp_path / "adapters")


def test_endpoints_json_lives_as_long_as_the_cluster(tmp_path, monkeypatch):
    endpoints = tmp_path / "logs" / ENDPOINTS_FILE
    cluster = Cluster(_stand_in_spec(tmp_path, monkeypatch))
    cluster.start(timeout_s=60)
    try:
        assert f'"gateway": "{cluster.spec.address("gateway")}"' in endpoints.read_text()
    finally:
        cluster.stop()
    assert not endpoints.exists()

    failing = Cluster(_stand_in_spec(tmp_path, monkeypatch, lambda name: ["never"] if name == "gateway" else []))
    with pytest.raises(StartupError, match="^gateway failed to start: not SERVING after 2 s"):
        failing.start(timeout_s=2)
    assert not endpoints.exists()


def test_a_restarted_process_never_serving_is_killed_after_the_start_timeout_and_retried(tmp_path, monkeypatch,
                                                                                        capsys):
    never = set()
    cluster = Cluster(_stand_in_spec(tmp_path, monkeypatch, lambda name: ["never"] if name in never else []))
    cluster.start(timeout_s=60)
    try:
        supervisor = Supervisor(cluster, backoff=CrashLoopBackoff(first_s=0.5), start_timeout_s=2.0)
        never.add("pooling")
        first = cluster.processes["pooling"]
        first.kill()
        first.wait()
        printed, deadline = "", time.monotonic() + 30
        while time.monotonic() < deadline and "next try in 1 s" not in printed:
            supervisor.step()
            printed += capsys.readouterr().err
            time.sleep(0.1)
        lines = printed.splitlines()
        assert re.fullmatch(r"pooling exited unexpectedly \(code -9\); next try in 0\.5 s, at [\d:]{8}", lines[0])
        assert re.fullmatch(r"pooling failed to start: not SERVING after 2 s; next try in 1 s, at [\d:]{8}", lines[1])
        assert cluster.processes["pooling"].returncode == -signal.SIGKILL  # the restarted one, killed
        assert all(cluster.processes[name].poll() is None for name in cluster.processes if name != "pooling")
    finally:
        cluster.stop()
