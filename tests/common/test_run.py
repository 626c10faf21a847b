"""One exit-code rule for the five `python -m services.<name>` (services/common/run.py): 2 and one
line for a bad flag or value, 1 and one line for a failure at start."""

from __future__ import annotations

import socket
import subprocess
import sys

from services.common.launch import REPO, free_port

SERVICES = ("adapters", "decoder", "gateway", "pooling", "vision")


def _start_all(argv_of: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """Every service's process at once (each imports its engine), then their results."""
    processes = {name: subprocess.Popen([sys.executable, "-m", f"services.{name}", *argv], cwd=REPO, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for name, argv in argv_of.items()}
    results = {}
    for name, process in processes.items():
        out, err = process.communicate(timeout=180)
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return results


def test_a_bad_value_exits_2_in_one_line_naming_it():
    address = f"127.0.0.1:{free_port()}"
    results = _start_all({name: ["--address", address, "--metrics-port", "70000"] for name in SERVICES})
    for name, result in results.items():
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (name, result.stderr)
        assert lines[-1].startswith(f"python -m services.{name}: error: ") and "70000" in lines[-1], (name, lines)


def test_a_bad_flag_exits_2_as_argparse_does():
    results = _start_all({name: ["--no-such-flag"] for name in ("adapters", "gateway")})
    for name, result in results.items():
        assert result.returncode == 2, (name, result.stderr)
        assert result.stderr.strip().splitlines()[-1] == (f"python -m services.{name}: error: unrecognized "
                                                          "arguments: --no-such-flag")


def test_a_failure_at_start_exits_1_in_one_line(tmp_path):
    with socket.socket() as held:  # the port is taken: the start fails, the config was fine
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        results = _start_all({"adapters": ["--address", address, "--root", str(tmp_path)],
                              "gateway": ["--address", address]})
    for name, result in results.items():
        assert result.returncode == 1, (name, result.stderr)
        assert result.stderr.strip().splitlines()[-1].startswith(f"{name}: cannot listen on {address}"), result.stderr


def test_a_metrics_port_in_use_exits_1_in_one_line_naming_it(tmp_path):
    """The registry as every other service: the busy /metrics port named, its flag, no traceback."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        results = _start_all({"adapters": ["--address", f"127.0.0.1:{free_port()}", "--root", str(tmp_path),
                                           "--db", str(tmp_path / "catalog.sqlite3"), "--metrics-port", str(port)],
                              "gateway": ["--address", f"127.0.0.1:{free_port()}", "--metrics-port", str(port)]})
    for name, result in results.items():
        assert result.returncode == 1, (name, result.stderr)
        assert "Traceback" not in result.stderr, (name, result.stderr)
        assert result.stderr.splitlines()[-1] == (f"{name}: cannot serve /metrics on 127.0.0.1:{port} "
                                                  "(--metrics-port): Address already in use"), (name, result.stderr)
