"""Shared by bench/decode.py and bench/prefix.py: start a decoder subprocess, describe the machine."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_decoder(model_dir: Path, flags: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """`python -m services.decoder` on a free port; returns once health says SERVING."""
    address = f"127.0.0.1:{_free_port()}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("w")
    process = subprocess.Popen([sys.executable, "-m", "services.decoder", "--address", address, "--model-dir",
                                str(model_dir), *flags], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    with grpc.insecure_channel(address) as channel:
        health, deadline = health_pb2_grpc.HealthStub(channel), time.monotonic() + 300
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"decoder exited: {log_path.read_text()[-2000:]}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return process, address
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    process.kill()
    raise TimeoutError("decoder not SERVING after 300 s")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs, {gpu}, torch "
            f"{torch.__version__} ({torch.get_num_threads()} threads), python {platform.python_version()}")
