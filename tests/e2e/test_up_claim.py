"""A second `tessera up` beside the running cluster: on its ports, or under its name, it exits 1
at once naming the port or the cluster, and leaves the running cluster's internal-token file as it
was, so the cluster's next restarted service (kill -9 of pooling) still authenticates its hops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.common.healthcheck import check as check_health
from services.common.launch import REPO
from tessera.cli.up.supervise import RestartPolicy, Supervisor
from tessera.paths import default_decoder_dir, default_embedding_dir

from .conftest import embed_once_back

UP_TIMEOUT_S = 120  # it refuses before loading anything; a start would take far longer on a loaded machine


def _second_up(home: Path, adapter_root: Path, *argv: str) -> subprocess.CompletedProcess:
    """`tessera up ARGV` with $TESSERA_HOME `home`; its process group is killed if it does not exit."""
    command = [sys.executable, "-m", "tessera.cli.main", "up", "--decoder-model-dir", str(default_decoder_dir()),
               "--embedding-model-dir", str(default_embedding_dir()), "--adapter-root", str(adapter_root), *argv]
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "TESSERA_HOME": str(home)}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = process.communicate(timeout=UP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # it started services of its own: none may outlive the test
        out, err = process.communicate()
        raise AssertionError(f"a second `tessera up` {argv} did not exit: {err[-2000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def test_a_second_up_on_the_ports_or_the_name_of_a_running_cluster_exits_1_and_keeps_its_token(
        cluster, gateway, tmp_path):
    spec, token = cluster.spec, Path(cluster.token_file).read_bytes()
    same_ports = _second_up(tmp_path / "home", tmp_path / "adapters", "--base-port", str(spec.base_port),
                            "--http-port", str(spec.http_port), "--cluster", "another")
    first = spec.services()[0]
    assert same_ports.returncode == 1, same_ports.stderr
    assert same_ports.stderr == (f"error: {first} gRPC port {spec.address(first)} is in use (Address already in "
                                 "use): stop the process that holds it, or choose another --base-port\n")
    assert not (tmp_path / "home").exists()  # nothing written

    # the running cluster's own directory, where `up --cluster NAME` looks for it under this home
    logs = tmp_path / "same-home" / "clusters" / spec.cluster / "logs"
    logs.parent.mkdir(parents=True)
    logs.symlink_to(spec.log_dir)
    same_name = _second_up(tmp_path / "same-home", tmp_path / "adapters", "--base-port",
                           str(spec.base_port + 1000), "--http-port", "0", "--cluster", spec.cluster)
    assert same_name.returncode == 1, same_name.stderr
    assert same_name.stderr.startswith(f"error: cluster {spec.cluster!r} is running (tessera up, pid {os.getpid()}"), \
        same_name.stderr
    assert Path(cluster.token_file).read_bytes() == token

    killed = cluster.processes["pooling"]
    killed.send_signal(signal.SIGKILL)
    supervisor = Supervisor(cluster, RestartPolicy(unhealthy_s=2.0))
    started = time.monotonic()
    while cluster.processes["pooling"] is killed or check_health(spec.address("pooling")) is not None:
        supervisor.step()
        assert time.monotonic() - started < 180, f"pooling was not restarted:\n{cluster.log_tail('pooling')}"
        time.sleep(0.5)
    assert list(embed_once_back(gateway).embeddings.shape) == [1, 384]  # the restarted pooler took the same token
