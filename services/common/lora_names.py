"""Names of LoRA targets the adapter registry and the decoder agree on.

A linear is named as its checkpoint names it ("model.layers.0.self_attn.q_proj"). A routed MoE
expert (transformers 5's 3-D `mlp.experts.gate_up_proj` [experts, 2 * inter, hidden] and
`mlp.experts.down_proj` [experts, hidden, inter], PEFT's `target_parameters`) is adapted expert by
expert: "<layer>.mlp.experts.<e>.<part>". The router's weight (`mlp.gate.weight`, PEFT's target_parameters
"gate.weight") is adapted as the linear "<layer>.mlp.gate".
"""

from __future__ import annotations

import re

EXPERT_PARTS = ("gate_up_proj", "down_proj")  # in transformers 5's declaration order (PEFT nests them so)
_EXPERT_TARGET = re.compile(r"^(?P<group>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_up_proj|down_proj)$")


ROUTER_WEIGHT = "gate.weight"


def expert_target(name: str) -> tuple[str, int] | None:
    """("<group>.<part>", e) of a per-expert target name "<group>.<e>.<part>"; None for other names."""
    match = _EXPERT_TARGET.match(name)
    return None if match is None else (f"{match['group']}.{match['part']}", int(match["expert"]))
