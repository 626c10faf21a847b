"""LoRA compute backends behind one interface: torch (grouped shrink/expand) and Triton.

Contract of `LoRABackend.add_lora(y, x, a, b, batch)`: for every row t whose slot s = batch.token_slots[t]
is not -1,  y[t] += (x[t] @ a[s].T) @ b[s].T ; base rows of `y` are left untouched (bit for bit).

    x: [num_tokens, in_features]      any float dtype (the model's)
    y: [num_tokens, out_features]     updated in place, same dtype as x
    a: [num_slots, max_rank, in]      shrink factors, zero-padded past each adapter's rank
    b: [num_slots, out, max_rank]     expand factors, LoRA scale already folded in

Accumulation is float32 (at least), then cast to y's dtype once.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch

from services.decoder.kernels.batch import LoRABatch

BACKENDS = ("torch", "triton")


class LoRABackend(ABC):
    name: str = ""

    @abstractmethod
    def add_lora(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 batch: LoRABatch) -> None:
        """Add each adapter row's low-rank correction to `y` in place (see module docstring)."""


class TorchLoRABackend(LoRABackend):
    """Grouped shrink/expand: one bmm pair over the step's slot groups padded to the longest
    (`LoRABatch.padded`), or one gathered matmul pair per slot when padding would waste more."""

    name = "torch"

    def add_lora(self, y, x, a, b, batch):
        compute = torch.promote_types(a.dtype, torch.float32)
        pad = batch.padded
        if pad is not None:  # all slots in one bmm pair over the zero-padded [groups, max_len] grid
            grid = torch.zeros(len(pad.slots), pad.max_len, x.shape[1], dtype=compute, device=x.device)
            grid[pad.group, pad.pos] = x[pad.rows].to(compute)
            shrunk = torch.bmm(grid, a[pad.slots].to(compute).transpose(1, 2))          # [g, len, max_rank]
            delta = torch.bmm(shrunk, b[pad.slots].to(compute).transpose(1, 2))[pad.group, pad.pos]
            y[pad.rows] = (y[pad.rows].to(compute) + delta).to(y.dtype)
            return
        for slot, rows in batch.slot_rows:
            shrunk = x[rows].to(compute) @ a[slot].to(compute).T       # [n, max_rank]
            delta = shrunk @ b[slot].to(compute).T                      # [n, out]
            y[rows] = (y[rows].to(compute) + delta).to(y.dtype)


def triton_available() -> str | None:
    """None if Triton kernels can run here, else the reason (no CUDA device, no interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError as error:  # pragma: no cover - triton ships with torch
        return f"triton is not importable: {error}"
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "no CUDA device and TRITON_INTERPRET is not 1"


def make_backend(name: str) -> LoRABackend:
    """Backend by flag value ("torch" or "triton").

    Raises:
        ValueError: unknown name, or "triton" where Triton cannot run (see triton_available).
    """
    if name == "torch":
        return TorchLoRABackend()
    if name == "triton":
        reason = triton_available()
        if reason is not None:
            raise ValueError(f"lora_backend 'triton' cannot run here: {reason}; use 'torch'")
        from services.decoder.kernels.triton_lora import TritonLoRABackend
        return TritonLoRABackend()
    raise ValueError(f"lora_backend must be one of {BACKENDS}, got {name!r}")
