"""The model's LoRA-capable projection: a linear layer that asks the step's LoRA context for its correction."""

from __future__ import annotations

import torch
from torch import nn

from tessera.decoder.linear import linear
from tessera.decoder.lora.context import LoRAContext


class LoRALinear(nn.Linear):
    """nn.Linear whose output gets the step's per-token LoRA correction (parameter names unchanged).

    `lora_name` is the module's name in the checkpoint (the key of its factors in `AdapterSlots`).
    """

    lora_name: str = ""
    lora_context: LoRAContext | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        if self.lora_context is not None and self.lora_context.active:
            self.lora_context.apply(self.lora_name, x, y)
        return y


def attach_context(model: nn.Module, context: LoRAContext) -> None:
    """Point every LoRALinear of `model` at `context`."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.lora_context = context


def target_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-capable linear, by module name."""
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, LoRALinear)}
