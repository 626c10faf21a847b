"""One service as a real OS process for a test: a free port, wait for SERVING, SIGTERM at the end.

    with ServiceProcess("services.pooling", ["--max-batch-size", "4"]) as service:
        channel = grpc.insecure_channel(service.address)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServiceProcess:
    """`python -m <module> --address 127.0.0.1:<free port> <args>`, logging to a temporary file
    (a file, not a pipe: a full pipe would stall the server)."""

    def __init__(self, module: str, args: list[str] = (), env: dict[str, str] | None = None,
                 startup_s: float = 90.0):
        self.module, self.args, self.startup_s = module, list(args), startup_s
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.address = f"127.0.0.1:{free_port()}"
        self.process: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix=f"{module}-", suffix=".log", delete=False)

    def __enter__(self) -> "ServiceProcess":
        self.process = subprocess.Popen([sys.executable, "-m", self.module, "--address", self.address, *self.args],
                                        cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + self.startup_s
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.process.poll() is None, f"{self.module} exited:\n{self.log()[-3000:]}"
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"{self.module} not SERVING after {self.startup_s} s:\n{self.log()[-3000:]}")

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (the service drains), SIGKILL if it does not exit in time; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode
