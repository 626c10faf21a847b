"""Paged attention backends, chosen by name (`--attention-backend`).

    backend.py          the interface: AttentionBackend (build_metadata, write_kv, forward), AttentionMetadata
    torch_backend.py    "torch": SDPA per prefill span, decode rows batched in length groups (CPU default)
    cpu_backend.py      "cpu": decode rows in the C kernel kernels/paged_attention.c (float32)
    triton_backend.py   "triton": every row in one Triton kernel (triton_kernel.py; GPU or TRITON_INTERPRET=1)

A new backend is one module with its metadata dataclass and `AttentionBackend` subclass, plus its
line in `ATTENTION_BACKENDS`; the decoder config validates `attention_backend` against this table.
"""

from tessera.decoder.attention.backend import AttentionBackend, AttentionMetadata
from tessera.decoder.attention.cpu_backend import CpuAttentionBackend
from tessera.decoder.attention.torch_backend import TorchAttentionBackend
from tessera.decoder.attention.triton_backend import TritonAttentionBackend

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.name: backend for backend in (TorchAttentionBackend, TritonAttentionBackend, CpuAttentionBackend)
}


def make_attention_backend(name: str) -> AttentionBackend:
    """The backend registered as `name`, constructed (the cpu backend builds its C kernel here).

    Raises:
        ValueError: no backend of that name (the message lists the registered ones), or one that
            cannot run on this machine (cpu: no working C compiler).
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {tuple(ATTENTION_BACKENDS)}, got {name!r}")
    return ATTENTION_BACKENDS[name]()


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "make_attention_backend"]
