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

    def end_step(self) -> None:
        """The step's forward is over: drop anything kept for it."""


class TorchLoRABackend(LoRABackend):
    """Grouped shrink/expand: one bmm pair over the step's slot groups padded to the longest
    (`LoRABatch.padded`), or one gathered matmul pair per slot when padding would waste more."""

    name = "torch"

    def __init__(self) -> None:
        self._grid: tuple[torch.Tensor, LoRABatch, torch.Tensor] | None = None  # (x, batch, grid) last built

    def add_lora(self, y, x, a, b, batch):
        compute = torch.promote_types(a.dtype, torch.float32)
        pad = batch.padded
        if pad is not None:  # every slot in one bmm pair over the [groups, max_len] grid
            groups = pad.slots.numel()
            if not (pad.leading_slots and groups == a.shape[0]):
                a, b = a.index_select(0, pad.slots), b.index_select(0, pad.slots)
            grid = self._grid_of(x, batch, compute)                                        # [g, len, in]
            shrunk = torch.bmm(grid, a.to(compute).transpose(1, 2))                        # [g, len, max_rank]
            delta = torch.bmm(shrunk, b.to(compute).transpose(1, 2)).view(-1, y.shape[1])  # [g * len, out]
            if pad.row_cells is not None and delta.dtype == y.dtype:
                y.add_(delta.index_select(0, pad.row_cells))  # every row has an adapter: one dense add
                return
            if pad.cells is not None:
                delta = delta.index_select(0, pad.cells)
            self._add_rows(y, pad.rows, delta)
            return
        for slot, rows in batch.slot_rows:
            shrunk = x.index_select(0, rows).to(compute) @ a[slot].to(compute).T   # [n, max_rank]
            self._add_rows(y, rows, shrunk @ b[slot].to(compute).T)                 # [n, out]

    def end_step(self) -> None:
        self._grid = None  # do not hold the last layer's input while idle

    def _grid_of(self, x: torch.Tensor, batch: LoRABatch, compute: torch.dtype) -> torch.Tensor:
        """x's rows on the padded grid; q/k/v (and gate/up) read the same x, so it is gathered once."""
        last = self._grid
        if last is not None and last[0] is x and last[1] is batch and last[2].dtype == compute:
            return last[2]
        pad = batch.padded
        grid = x.index_select(0, pad.grid_rows).to(compute).view(pad.slots.numel(), pad.max_len, x.shape[1])
        self._grid = (x, batch, grid)
        return grid

    @staticmethod
    def _add_rows(y: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor) -> None:
        """y[rows] += delta, rounded once to y's dtype (row gather, add, row copy: on CPU several
        times faster than index_add_/index_put_, which scatter element by element)."""
        y.index_copy_(0, rows, (y.index_select(0, rows).to(delta.dtype) + delta).to(y.dtype))


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
