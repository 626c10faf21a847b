"""LoRA backends by name: the `--lora-backend` choices and the one place that builds a backend.

Each factory imports its implementation when called, so listing or validating names loads
neither Triton nor the C compiler. Adding a backend is one module beside this one and one entry
in `LORA_BACKENDS`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from services.decoder.lora.backend import LoRABackend

log = logging.getLogger(__name__)
AUTO = "auto"  # resolve_lora_backend's choice for the device and dtype


def triton_available() -> str | None:
    """None if Triton kernels can run here, else the reason (no CUDA device, no interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError as error:  # pragma: no cover - triton ships with torch
        return f"triton is not importable: {error}"
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "no CUDA device and TRITON_INTERPRET is not 1"


def _torch() -> LoRABackend:
    from services.decoder.lora.torch_backend import TorchLoRABackend

    return TorchLoRABackend()


def _cpu() -> LoRABackend:
    from services.decoder.lora.cpu_backend import CpuLoRABackend

    try:
        return CpuLoRABackend()  # builds the C kernels (once per process)
    except RuntimeError as error:
        raise ValueError(f"lora_backend 'cpu' cannot run here: {error}") from error


def _triton() -> LoRABackend:
    reason = triton_available()
    if reason is not None:
        raise ValueError(f"lora_backend 'triton' cannot run here: {reason}; use 'torch'")
    from services.decoder.lora.triton_backend import TritonLoRABackend

    return TritonLoRABackend()


# name -> factory: "torch" grouped shrink/expand, "triton" BGMV/SGMV kernels, "cpu" C BGMV for decode rows
LORA_BACKENDS: dict[str, Callable[[], LoRABackend]] = {"torch": _torch, "triton": _triton, "cpu": _cpu}


def check_dtype(name: str, dtype: str) -> None:
    """Refuse a model dtype (a torch dtype name) that backend `name` does not compute, building nothing.

    Raises:
        ValueError: "cpu" with a dtype other than float32 and bfloat16 (kernels/native.py DTYPES).
    """
    if name == "cpu":
        from services.decoder.kernels import native

        if dtype not in native.DTYPES:
            raise ValueError(f"the cpu LoRA backend computes {' and '.join(native.DTYPES)} only, got dtype {dtype!r}")


def resolve_lora_backend(name: str, device: torch.device, dtype: str) -> str:
    """The backend to build for `name` on `device` with model dtype `dtype`: `name` itself, or for
    "auto" the fastest that runs there: "triton" on a CUDA device (where Triton imports), "cpu" on
    the CPU where its C kernels build and compute `dtype` (they are built now), else "torch".
    An automatic choice is logged with the reason for any fallback."""
    if name != AUTO:
        return name
    reason = None
    if device.type == "cuda":
        reason = triton_available()
        choice = "triton" if reason is None else "torch"
    elif device.type == "cpu":
        from services.decoder.kernels import native

        reason = native.unavailable(dtype)
        choice = "cpu" if reason is None else "torch"
    else:
        choice, reason = "torch", f"no kernels for {device.type} devices"
    log.info("lora_backend auto: %s on %s for %s%s", choice, device, dtype, f" ({reason})" if reason else "")
    return choice


def make_backend(name: str) -> LoRABackend:
    """The backend registered as `name`.

    Raises:
        ValueError: unknown name, "triton" where Triton cannot run (see triton_available), or "cpu"
            where its kernel cannot be built (no C compiler with OpenMP; the message names the
            command, its exit code and output).
    """
    factory = LORA_BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"lora_backend must be one of {tuple(LORA_BACKENDS)}, got {name!r}")
    return factory()
