"""Shared by bench/decode.py and bench/prefix.py: start a decoder subprocess, describe the machine."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from services.common.launch import ServiceProcess, free_port  # noqa: F401 - free_port for bench/lora.py

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def start_decoder(model_dir: Path, flags: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """`python -m services.decoder` on a free port; returns once health says SERVING."""
    service = ServiceProcess("services.decoder", ["--model-dir", str(model_dir), *flags],
                             env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)}, startup_s=300, log_path=log_path)
    service.start()
    return service.process, service.address


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def machine() -> str:
    import torch

    from services.decoder.kernels.native import cpu_flags, cpu_model

    cpu = platform.processor() or platform.machine()
    model = cpu_model()
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()]
    cpu = f"{cpu} ({model}; {' '.join(simd) or 'no AVX2'})" if model else cpu
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs, {gpu}, torch "
            f"{torch.__version__} ({torch.get_num_threads()} threads), python {platform.python_version()}")
