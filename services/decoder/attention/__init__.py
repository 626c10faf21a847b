"""Paged attention backends, chosen by name (`--attention-backend`).

    backend.py          the interface: AttentionBackend (build_metadata, write_kv, forward), AttentionMetadata
    torch_backend.py    "torch": SDPA per prefill span, decode rows batched in length groups (any device)
    cpu_backend.py      "cpu": decode rows in the C kernel kernels/paged_attention.c (float32, bfloat16)
    triton_backend.py   "triton": every row in one Triton kernel (triton_kernel.py; GPU or TRITON_INTERPRET=1)

A new backend is one module with its metadata dataclass and `AttentionBackend` subclass, plus its
line in `ATTENTION_BACKENDS`; the decoder config validates `attention_backend` against this table
and resolves "auto" with `resolve_attention_backend`.
"""

import logging

import torch

from services.decoder.attention.backend import AttentionBackend, AttentionMetadata
from services.decoder.attention.cpu_backend import CpuAttentionBackend
from services.decoder.attention.torch_backend import TorchAttentionBackend
from services.decoder.attention.triton_backend import TritonAttentionBackend
from services.decoder.kernels import native

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.name: backend for backend in (TorchAttentionBackend, TritonAttentionBackend, CpuAttentionBackend)
}

AUTO = "auto"  # resolve_attention_backend's choice for the device, dtype and block size
log = logging.getLogger(__name__)


def resolve_attention_backend(name: str, device: torch.device, dtype: str, block_size: int) -> str:
    """The backend to build for `name` on `device` with cache dtype `dtype`: `name` itself, or for
    "auto" the fastest that serves there: "triton" on a CUDA device (where it takes the block
    size), "cpu" on the CPU where its C kernel builds and computes `dtype` (it is built now),
    else "torch". An automatic choice is logged with the reason for any fallback."""
    if name != AUTO:
        return name
    reason = None
    if device.type in ("cuda", "cpu"):
        choice = "triton" if device.type == "cuda" else "cpu"
        try:
            ATTENTION_BACKENDS[choice].check_config(block_size, dtype)
        except ValueError as error:
            reason = str(error)
        if reason is None and choice == "cpu":
            reason = native.unavailable(dtype)
        choice = choice if reason is None else "torch"
    else:
        choice, reason = "torch", f"no kernels for {device.type} devices"
    log.info("attention_backend auto: %s on %s for %s%s", choice, device, dtype, f" ({reason})" if reason else "")
    return choice


def make_attention_backend(name: str) -> AttentionBackend:
    """The backend registered as `name`, constructed (the cpu backend builds its C kernel here).

    Raises:
        ValueError: no backend of that name (the message lists the registered ones), or one that
            cannot run on this machine (cpu: no working C compiler).
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {tuple(ATTENTION_BACKENDS)}, got {name!r}")
    return ATTENTION_BACKENDS[name]()


__all__ = ["ATTENTION_BACKENDS", "AUTO", "AttentionBackend", "AttentionMetadata", "make_attention_backend",
           "resolve_attention_backend"]
