"""Start a service as its own OS process and wait until its health check says SERVING.

Used by `tessera up`, the benchmarks and the tests, so every launcher waits the same way:
poll `grpc.health.v1` on the service's address, and give up with the log's tail if the process
exits or the deadline passes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from services.common import healthcheck

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_serving(address: str, process: subprocess.Popen, timeout_s: float, name: str,
                 log_tail: Callable[[], str] = lambda: "") -> None:
    """Block until `address` answers SERVING (healthcheck.wait_serving).

    Raises:
        RuntimeError: the process exited first (the message carries the log's tail).
        TimeoutError: not SERVING within `timeout_s` seconds.
    """
    def exited() -> str | None:
        if process.poll() is None:
            return None
        return f"{name} exited with code {process.returncode} during startup:\n{log_tail()}"

    try:
        healthcheck.wait_serving(address, timeout_s, exited)
    except TimeoutError:
        raise TimeoutError(f"{name} at {address} not SERVING after {timeout_s:.0f} s:\n{log_tail()}") from None


# Environment defaults of every service process (the caller's environment wins). GNU OpenMP's
# workers spin waiting for the next parallel region; a shorter spin leaves the cores to the other
# services (bench/results/settings.md). libgomp reads it when torch loads, so it is set in the
# launcher rather than in the service.
SERVICE_ENV_DEFAULTS = {"GOMP_SPINCOUNT": "20000"}


def service_env(overrides: dict[str, str] | None = None) -> dict[str, str]:
    """A service process's environment: SERVICE_ENV_DEFAULTS, then os.environ, then `overrides`."""
    return {**SERVICE_ENV_DEFAULTS, **os.environ, **(overrides or {})}


class ServiceProcess:
    """`python -m <module> --address 127.0.0.1:<free port> <args>`, logging to a file (never a pipe:
    a full pipe would stall the server). A context manager; `stop()` sends SIGTERM (the service
    drains) and SIGKILL if it does not exit in time.

        with ServiceProcess("services.pooling", ["--max-batch-size", "4"]) as service:
            channel = grpc.insecure_channel(service.address)
    """

    def __init__(self, module: str, args: list[str] = (), env: dict[str, str] | None = None,
                 startup_s: float = 90.0, log_path: Path | None = None):
        self.module, self.args, self.startup_s = module, list(args), startup_s
        self.env = service_env({"OMP_NUM_THREADS": "1", **(env or {})})
        self.address = f"127.0.0.1:{free_port()}"
        self.process: subprocess.Popen | None = None
        if log_path is None:
            log_path = Path(tempfile.mkstemp(prefix=f"{module}-", suffix=".log")[1])
        self.log_path = Path(log_path)

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen([sys.executable, "-m", self.module, "--address", self.address, *self.args],
                                            cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_serving(self.address, self.process, self.startup_s, self.module, lambda: self.log()[-3000:])
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
