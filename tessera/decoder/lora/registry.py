"""LoRA backends by name: the `--lora-backend` choices and the one place that builds a backend.

Each factory imports its implementation when called, so listing or validating names loads
neither Triton nor the C compiler. Adding a backend is one module beside this one and one entry
in `LORA_BACKENDS`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tessera.decoder.lora.backend import LoRABackend


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
    from tessera.decoder.lora.torch_backend import TorchLoRABackend

    return TorchLoRABackend()


def _cpu() -> LoRABackend:
    from tessera.decoder.lora.cpu_backend import CpuLoRABackend

    try:
        return CpuLoRABackend()  # builds the C kernels (once per process)
    except RuntimeError as error:
        raise ValueError(f"lora_backend 'cpu' cannot run here: {error}") from error


def _triton() -> LoRABackend:
    reason = triton_available()
    if reason is not None:
        raise ValueError(f"lora_backend 'triton' cannot run here: {reason}; use 'torch'")
    from tessera.decoder.lora.triton_backend import TritonLoRABackend

    return TritonLoRABackend()


# name -> factory: "torch" grouped shrink/expand, "triton" BGMV/SGMV kernels, "cpu" C BGMV for decode rows
LORA_BACKENDS: dict[str, Callable[[], LoRABackend]] = {"torch": _torch, "triton": _triton, "cpu": _cpu}
# the only backends that compute float32 only (checked by the decoder config without building them)
FLOAT32_ONLY = frozenset({"cpu"})


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
