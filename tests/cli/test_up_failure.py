"""`tessera up` with a service that cannot start: one cause line, the log's last lines, the
others stopped, a non-zero exit, and no traceback of `up`'s own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testing import process_argvs

from services.common.launch import REPO, free_port
from tessera.cli.logfiles import StartupError
from tessera.cli.up.launch import STARTUP_TAIL_LINES
from tessera.paths import default_decoder_dir, default_embedding_dir


def _up(tmp_path: Path, *service_args: str) -> tuple[subprocess.CompletedProcess, int]:
    base = free_port()
    command = [sys.executable, "-m", "tessera.cli.main", "up", "--base-port", str(base), "--http-port", "0",
               "--decoder-model-dir", str(default_decoder_dir()),
               "--embedding-model-dir", str(default_embedding_dir()), "--adapter-root", str(tmp_path / "adapters"),
               *(arg for value in service_args for arg in ("--service-args", value))]
    env = {**os.environ, "TESSERA_HOME": str(tmp_path / "home")}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600), base


def _running_with(port: int) -> list[str]:
    """Command lines of processes bound (by flag) to `port`."""
    return [" ".join(a.decode(errors="replace") for a in argv) for _, argv in process_argvs()
            if any(arg.decode(errors="replace").endswith(f":{port}") for arg in argv)]


def test_a_gateway_flag_it_refuses_fails_the_start_in_one_line(tmp_path):
    result, base = _up(tmp_path, "gateway=--max-path-chars 0")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "gateway failed to start: python -m services.gateway: error: max_path_chars must be >= 1, " \
                       "got 0 (exited with code 2)"
    log = tmp_path / "home" / "clusters" / str(base) / "logs" / "gateway.log"
    assert lines[1] == f"last 1 lines of {log}:"  # a refused value is one line (services/common/run.py)
    assert lines[2] == "  python -m services.gateway: error: max_path_chars must be >= 1, got 0"
    assert "Traceback" not in result.stdout + result.stderr
    assert lines[-1] == "stopped the other services"
    assert not _running_with(base + 2), "the decoder outlived the failed start"


def test_the_report_names_the_cause_and_shows_the_tail():
    tail = [f"line {i}" for i in range(STARTUP_TAIL_LINES)]
    error = StartupError("decoder", "exited with code 1", "ValueError: num_blocks must be >= 0", tail,
                         Path("/logs/decoder.log"))
    lines = error.report().splitlines()
    assert lines[0] == "decoder failed to start: ValueError: num_blocks must be >= 0 (exited with code 1)"
    assert lines[1] == f"last {STARTUP_TAIL_LINES} lines of /logs/decoder.log:"
    assert lines[2:] == [f"  {line}" for line in tail]
    timed_out = StartupError("vision", "not SERVING after 300 s", None, [], Path("/v.log"))
    assert timed_out.report() == "vision failed to start: not SERVING after 300 s"


def test_service_args_that_do_not_split_are_refused_naming_the_flag():
    from tessera.cli.up.spec import parse_extra

    assert parse_extra(["decoder=--num-blocks 64 --name 'a b'"]) == {"decoder": ["--num-blocks", "64", "--name", "a b"]}
    with pytest.raises(ValueError, match=r"""--service-args "decoder=--foo 'x": No closing quotation"""):
        parse_extra(["decoder=--foo 'x"])
    with pytest.raises(ValueError, match="SERVICE in"):
        parse_extra(["nosuch=--x 1"])


def test_ctrl_c_while_starting_stops_everything_and_says_so(tmp_path):
    """Ctrl-C reaches the whole foreground process group: the services die of it too, and that is
    no start failure of theirs. `up` says it was interrupted, exits 130 and leaves nothing running."""
    import signal
    import time

    base = free_port()
    command = [sys.executable, "-m", "tessera.cli.main", "up", "--base-port", str(base), "--http-port", "0",
               "--decoder-model-dir", str(default_decoder_dir()),
               "--embedding-model-dir", str(default_embedding_dir()), "--adapter-root", str(tmp_path / "adapters")]
    env = {**os.environ, "TESSERA_HOME": str(tmp_path / "home")}
    up = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
    assert up.stdout.readline().startswith("starting ")  # the services are being spawned
    time.sleep(1.5)
    os.killpg(up.pid, signal.SIGINT)
    out, err = up.communicate(timeout=120)
    assert up.returncode == 130, err
    assert err.splitlines() == ["interrupted while starting: stopped the services"]
    assert "Traceback" not in out + err
    for offset in range(5):
        assert not _running_with(base + offset)
