"""LoRA compute backends behind one interface: torch (grouped shrink/expand) and Triton.

Contract of `LoRABackend.add_lora(y, x, a, b, batch)`: for every row t whose slot s = batch.token_slots[t]
is not -1,  y[t] += (x[t] @ a[s].T) @ b[s].T ; base rows of `y` are left untouched (bit for bit).

    x: [num_tokens, in_features]      any float dtype (the model's)
    y: [num_tokens, out_features]     updated in place, same dtype as x
    a: [num_slots, max_rank, in]      shrink factors, zero-padded past each adapter's rank
    b: [num_slots, out, max_rank]     expand factors, LoRA scale already folded in; the bank stores
                                      them as the transposed view of [num_slots, max_rank, out]

Accumulation is float32 (at least), then cast to y's dtype once.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch

from services.decoder.kernels.batch import BASE_SLOT, LoRABatch

BACKENDS = ("torch", "triton", "cpu")


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


class CpuLoRABackend(LoRABackend):
    """Decode rows through the C BGMV kernel (kernels/lora_bgmv.c), prefill rows through the torch backend.

    A decode step is memory-bound on the factors: the kernel reads each slot's A and B^T once per
    projection and adds into y in place, where the torch backend gathers rows onto a padded grid,
    runs two bmm and scatters the deltas back. Prefill segments are compute-bound GEMMs, which MKL
    (the torch backend) does best. float32 only; B must be stored as the bank stores it (the
    transposed view of a contiguous [slots, max_rank, out]; other layouts are copied per call).
    """

    name = "cpu"

    def __init__(self) -> None:
        from services.decoder.kernels import native

        self._kernel = native.load().tessera_lora_bgmv_f32
        self._torch = TorchLoRABackend()
        self._step: tuple[LoRABatch, tuple | None, LoRABatch | None] | None = None

    def add_lora(self, y, x, a, b, batch):
        if any(t.dtype != torch.float32 for t in (x, y, a, b)):
            raise ValueError("the cpu LoRA backend computes float32 only")
        if y.stride(-1) != 1:
            raise ValueError("LoRA output must have a contiguous last dimension")
        num_slots, rank, in_f = a.shape
        if b.shape != (num_slots, y.shape[1], rank) or x.shape[1] != in_f or x.shape[0] != y.shape[0]:
            raise ValueError(f"LoRA shapes do not fit: x {tuple(x.shape)}, y {tuple(y.shape)}, "
                             f"a {tuple(a.shape)}, b {tuple(b.shape)}")
        decode, prefill = self._split(batch)
        if prefill is not None:
            self._torch.add_lora(y, x, a, b, prefill)
        if decode is None:
            return
        if x.stride(-1) != 1:
            x = x.contiguous()
        a, bt = a.contiguous(), b.transpose(1, 2).contiguous()  # no copies for the bank's layout
        rows, starts, slots = decode
        shrunk = torch.empty(rows.numel(), rank, dtype=torch.float32)
        self._kernel(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), a.data_ptr(), bt.data_ptr(),
                     rows.data_ptr(), starts.data_ptr(), slots.data_ptr(), slots.numel(), in_f,
                     bt.shape[2], rank, shrunk.data_ptr(), torch.get_num_threads())

    def end_step(self) -> None:
        self._step = None
        self._torch.end_step()

    def _split(self, batch: LoRABatch) -> tuple[tuple | None, LoRABatch | None]:
        """(decode rows grouped by slot: rows, group starts [g + 1], group slots; or None) and the
        prefill rows' own LoRABatch (None without prefill adapter rows), built once per step."""
        if self._step is not None and self._step[0] is batch:
            return self._step[1], self._step[2]
        decode = None
        if batch.decode_rows.numel():
            order = torch.sort(batch.decode_slots, stable=True).indices
            slots, counts = torch.unique_consecutive(batch.decode_slots[order], return_counts=True)
            starts = torch.zeros(slots.numel() + 1, dtype=torch.long)
            torch.cumsum(counts, 0, out=starts[1:])
            decode = (batch.decode_rows[order].contiguous(), starts, slots.contiguous())
        prefill = None
        if batch.prefill_perm.numel():
            token_slots = batch.token_slots.clone()
            token_slots[batch.decode_rows] = BASE_SLOT
            prefill = LoRABatch.build(token_slots)
        self._step = (batch, decode, prefill)
        return decode, prefill


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
    """Backend by flag value ("torch", "triton" or "cpu").

    Raises:
        ValueError: unknown name, "triton" where Triton cannot run (see triton_available), or "cpu"
            where its kernel cannot be built (no C compiler with OpenMP).
    """
    if name == "torch":
        return TorchLoRABackend()
    if name == "cpu":
        try:
            return CpuLoRABackend()
        except RuntimeError as error:
            raise ValueError(f"lora_backend 'cpu' cannot run here: {error}") from error
    if name == "triton":
        reason = triton_available()
        if reason is not None:
            raise ValueError(f"lora_backend 'triton' cannot run here: {reason}; use 'torch'")
        from services.decoder.kernels.triton_lora import TritonLoRABackend
        return TritonLoRABackend()
    raise ValueError(f"lora_backend must be one of {BACKENDS}, got {name!r}")
