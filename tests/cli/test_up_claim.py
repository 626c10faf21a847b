"""`tessera up` checks every port it will use and its cluster's name before it writes or starts
anything: a port in use, or a cluster of that name running, is one line on stderr and exit status
1, and the running cluster's files (its internal token) are left as they were."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testing import free_base_port

from services.common.launch import REPO
from tessera.cli.main import main
from tessera.cli.up.claim import UP_PID_FILE, ClusterBusy, claim, running_pid
from tessera.cli.up.spec import METRICS_PORT_OFFSET, ClusterSpec
from tessera.paths import cluster_home, default_decoder_dir, default_embedding_dir

MODELS = {"decoder_model_dir": default_decoder_dir(), "embedding_model_dir": default_embedding_dir()}  # before $TESSERA_HOME moves


def _spec(cluster: str) -> ClusterSpec:
    return ClusterSpec(base_port=free_base_port(5), cluster=cluster, **MODELS)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TESSERA_CLUSTER", raising=False)
    return tmp_path / "home"


@pytest.fixture
def up(tmp_path, home, monkeypatch):
    """`tessera up ARGS` in this process on a free port range; a process it would start fails the test."""
    base = free_base_port(5)
    models = ["--decoder-model-dir", str(MODELS["decoder_model_dir"]),
              "--embedding-model-dir", str(MODELS["embedding_model_dir"])]

    def spawn(self, service):
        raise AssertionError(f"`up` started {service} although it should have refused")

    monkeypatch.setattr("tessera.cli.up.launch.Cluster.spawn", spawn)

    def run(*argv: str) -> int:
        return main(["up", *models, "--adapter-root", str(tmp_path / "adapters"), "--base-port", str(base), *argv])

    run.base = base
    return run


def _listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.mark.parametrize(("offset", "named"), [(0, "gateway gRPC port"), (3, "pooling gRPC port"),
                                               (4 + METRICS_PORT_OFFSET, "adapters metrics port")])
def test_a_grpc_or_metrics_port_in_use_is_refused_naming_it_before_anything_is_written(up, home, capsys, offset,
                                                                                       named):
    with _listen(up.base + offset):
        assert up("--http-port", "0") == 1
    err = capsys.readouterr().err
    assert err == (f"error: {named} 127.0.0.1:{up.base + offset} is in use (Address already in use): stop the "
                   "process that holds it, or choose another --base-port\n")
    assert not home.exists()  # no log dir, no token file


def test_the_http_port_in_use_names_the_http_flag(up, home, capsys):
    with _listen(0) as taken:
        port = taken.getsockname()[1]
        assert up("--http-port", str(port)) == 1
    assert capsys.readouterr().err == (f"error: gateway HTTP port 127.0.0.1:{port} is in use (Address already in "
                                       "use): stop the process that holds it, or choose another --http-port\n")
    assert not home.exists()


def test_a_running_cluster_of_that_name_is_refused_and_its_token_file_left_alone(up, home, capsys):
    running = _spec("prod")  # the first `up --cluster prod`, running
    held = claim(running)
    token = running.log_dir / "internal-token"
    token.write_bytes(b"the running cluster's token")
    try:
        assert up("--cluster", "prod", "--http-port", "0") == 1
        err = capsys.readouterr().err
        assert err == (f"error: cluster 'prod' is running (tessera up, pid {running_pid(held.path)}, holds "
                       f"{cluster_home('prod') / 'logs' / UP_PID_FILE}); stop it first, or give this cluster "
                       "another --cluster\n")
        assert token.read_bytes() == b"the running cluster's token"
        assert sorted(p.name for p in running.log_dir.iterdir()) == ["internal-token", UP_PID_FILE]
    finally:
        held.release()
    assert running_pid(held.path) is None  # given back: the next `up` of that name may start


def test_a_cluster_whose_up_was_killed_holds_no_claim(home):
    spec = _spec("crashed")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom tessera.cli.up.claim import claim\n"
                               "from tessera.cli.up.spec import ClusterSpec\n"
                               f"claim(ClusterSpec(base_port={spec.base_port}, cluster='crashed', "
                               f"decoder_model_dir={str(spec.decoder_model_dir)!r}, "
                               f"embedding_model_dir={str(spec.embedding_model_dir)!r}))\n"
                               "print('held', flush=True)\ntime.sleep(60)\n"], cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        assert running_pid(spec.log_dir / UP_PID_FILE) == holder.pid
        with pytest.raises(ClusterBusy, match=f"cluster 'crashed' is running \\(tessera up, pid {holder.pid}"):
            claim(spec)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    claim(spec).release()  # the kernel dropped the dead process's lock


def test_services_still_running_after_their_up_died_hold_the_name(home):
    """endpoints.json names a gateway that still listens (its `up` was killed, its services were not)."""
    spec = _spec("orphans")
    spec.log_dir.mkdir(parents=True)
    with _listen(0) as gateway:
        address = f"127.0.0.1:{gateway.getsockname()[1]}"
        (spec.log_dir / "endpoints.json").write_text(json.dumps({"gateway": address, "services": {}}))
        with pytest.raises(ClusterBusy, match=f"the gateway its .*endpoints.json lists still listens at {address}"):
            claim(spec)
    claim(spec).release()  # nothing listens there any more: a stale file holds nothing
