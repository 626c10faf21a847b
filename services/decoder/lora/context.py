"""The model runner's per-step LoRA state: the step's batch metadata and the backend that uses it.

`AdapterSlots` (slots.py) decides which adapters are resident and who leases them; this context
only computes. Per step, the model runner enters `step(token_slots, decode_rows)`, which builds
the step's `LoRABatch` (decode rows for BGMV, slot-sorted prefill segments for SGMV) once; every
`LoRALinear` of the forward then calls `apply`, which hands its module's factors and that batch to
the backend (as vLLM's Punica wrapper sits between its LoRA layers and kernels). No lock is held:
see `AdapterSlots` for why the rows a step reads cannot change under it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from services.decoder.lora.backend import LoRABackend
from services.decoder.lora.batch import LoRABatch
from services.decoder.lora.slots import AdapterSlots


class LoRAContext:
    """One model runner's LoRA compute: `step` scopes a forward pass, `apply` serves each projection.

    Used from the engine thread only (one step at a time).
    """

    def __init__(self, slots: AdapterSlots, backend: LoRABackend) -> None:
        self.slots = slots
        self.backend = backend
        self._batch: LoRABatch | None = None  # this step's row permutation / segments

    @contextmanager
    def step(self, token_slots: torch.Tensor | None, decode_rows: torch.Tensor | None = None) -> Iterator[None]:
        """Build the step's LoRA metadata once, reused by every projection of the forward inside.

        token_slots: int64 [num_tokens] slot per row (-1 = base); None = all base (no LoRA work).
        decode_rows: int64 rows that decode one token (BGMV); the rest are prefill (SGMV).
        """
        self._batch = None if token_slots is None else LoRABatch.build(token_slots, decode_rows)
        try:
            yield
        finally:
            self._batch = None
            self.backend.end_step()

    @property
    def active(self) -> bool:
        """True while a step with at least one adapter row is running."""
        return self._batch is not None

    @property
    def batch(self) -> LoRABatch | None:
        """This step's LoRA metadata while a step with at least one adapter row runs, else None."""
        return self._batch

    def apply_slices(self, slices: tuple[tuple[str, int, int], ...], x: torch.Tensor, y: torch.Tensor) -> None:
        """`apply` for each (module name, first column, end column) of `y` [rows, out] (a projection
        fused at load: q/k/v, gate/up), in one backend call where the backend takes several parts
        (`add_lora_parts`): each part gets what its own `apply` would add."""
        batch = self._batch
        if batch is None:
            return
        parts = []
        for name, start, end in slices:
            factors = self.slots.factors(name)
            if factors is not None:
                parts.append((factors[0], factors[1], start, end))
        add_parts = getattr(self.backend, "add_lora_parts", None)
        if add_parts is not None and len(parts) > 1:
            add_parts(y, x, parts, batch)
            return
        for a, b, start, end in parts:
            self.backend.add_lora(y[:, start:end], x, a, b, batch)  # a column view: updated in place

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch | None = None) -> None:
        """Add the LoRA correction of module `name` to `y` [rows, out] in place (x: [rows, in]).

        `batch`: the rows' own metadata where they are not the step's tokens (a MoE block's
        (token, expert) rows, whose "slots" index a stacked expert part: slots.py); default the step's.
        """
        factors = self.slots.factors(name)
        batch = batch or self._batch
        if factors is None or batch is None:
            return
        self.backend.add_lora(y, x, factors[0], factors[1], batch)
