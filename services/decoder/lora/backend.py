"""The LoRA compute interface: what every backend (torch, cpu, triton) implements.

This module imports no implementation: the registry (registry.py) names them and imports one
only when it is built, so choosing a backend never loads Triton or compiles a C kernel.

Contract of `LoRABackend.add_lora(y, x, a, b, batch)`: for every row t whose slot s = batch.token_slots[t]
is not -1,  y[t] += (x[t] @ a[s].T) @ b[s].T ; base rows of `y` are left untouched (bit for bit).

    x: [num_tokens, in_features]      any float dtype (the model's)
    y: [num_tokens, out_features]     updated in place, same dtype as x
    a: [num_slots, max_rank, in]      shrink factors, zero-padded past each adapter's rank
    b: [num_slots, out, max_rank]     expand factors, LoRA scale already folded in; AdapterSlots stores
                                      them as the transposed view of [num_slots, max_rank, out], or for
                                      a backend whose `tiled_bt` is True as B^T in lora_bgmv.c's tiles,
                                      [num_slots, max_rank * out] (slots.py `b_views`)

Accumulation is float32 (at least), then cast to y's dtype once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from services.decoder.lora.batch import LoRABatch


class LoRABackend(ABC):
    """Adds the step's per-row LoRA corrections; called once per targeted projection of a forward.

    A backend may keep state for the current step (metadata derived from the `LoRABatch`, an input
    gathered once for projections that share it); `end_step` drops it. One instance serves one
    model runner, from the engine thread only.
    """

    name: str = ""
    tiled_bt: bool = False  # whether AdapterSlots should store B as tiled B^T for this backend (module docstring)

    @abstractmethod
    def add_lora(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 batch: LoRABatch) -> None:
        """Add each adapter row's low-rank correction to `y` in place (see module docstring).

        Raises:
            ValueError: a dtype, layout or shape the backend does not compute.
        """

    def end_step(self) -> None:  # noqa: B027 - an optional hook; a stateless backend keeps nothing
        """The step's forward is over: drop anything kept for it."""
