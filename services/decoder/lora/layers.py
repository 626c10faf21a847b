"""The model's LoRA-capable projection: a linear layer that asks the step's LoRA context for its correction."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from services.decoder.linear import Linear
from services.decoder.lora.context import LoRAContext


class LoRALinear(Linear):
    """A Linear (nn.Linear; packed for the C GEMM on the cpu linear backend) whose output gets the
    step's per-token LoRA correction.

    `lora_slices` are (checkpoint module name, first output column, end column): one entry
    covering every column for a plain projection (e.g. "model.layers.0.self_attn.o_proj"), one per
    part for projections fused at load (q/k/v -> qkv_proj, gate/up -> gate_up_proj). Adapters stay
    per checkpoint module: each part's correction is added to its own column range of the fused
    output, exactly what the unfused projection would have received.
    """

    lora_slices: tuple[tuple[str, int, int], ...] = ()
    lora_context: LoRAContext | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.lora_context is not None and self.lora_context.active:
            if len(self.lora_slices) == 1:
                self.lora_context.apply(self.lora_slices[0][0], x, y)
            else:
                self.lora_context.apply_slices(self.lora_slices, x, y)
        return y


class LoRATargets(ABC):
    """A module other than a LoRALinear that takes LoRA on weights it applies itself (moe.py: the
    router, and the routed experts' 3-D weights, expert by expert): it names its targets and
    stacked parts, and reads `lora_context` in its forward."""

    lora_context: LoRAContext | None = None

    @abstractmethod
    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each target ("<prefix>.<e>.<part>" for an expert's)."""

    def lora_parts(self) -> dict[str, int]:
        """"<prefix>.<part>" -> number of experts, for each stacked part (slots.AdapterSlots)."""
        return {}


def attach_context(model: nn.Module, context: LoRAContext) -> None:
    """Point every LoRALinear and LoRATargets of `model` at `context`."""
    for module in model.modules():
        if isinstance(module, (LoRALinear, LoRATargets)):
            module.lora_context = context


def target_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-capable checkpoint projection (fused parts
    separately, routed experts one by one), by module name."""
    shapes = {name: (m.in_features, end - start) for m in model.modules() if isinstance(m, LoRALinear)
              for name, start, end in m.lora_slices}
    for module in model.modules():
        if isinstance(module, LoRATargets):
            shapes.update(module.lora_shapes())
    return shapes


def expert_parts(model: nn.Module) -> dict[str, int]:
    """The stacked expert parts of `model`'s LoRATargets ({} for a dense model)."""
    return {part: n for m in model.modules() if isinstance(m, LoRATargets) for part, n in m.lora_parts().items()}
