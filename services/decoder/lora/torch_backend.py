"""The torch LoRA backend: grouped shrink/expand with torch matmuls, on any device and dtype."""

from __future__ import annotations

import torch

from services.decoder.lora.backend import LoRABackend
from services.decoder.lora.batch import LoRABatch


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
