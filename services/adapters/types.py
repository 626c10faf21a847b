"""Domain types of the adapter registry: a parsed LoRA adapter, its content digest, an adapter's status."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from services.adapters.catalog import AdapterRecord


@dataclass(frozen=True)
class LoRATarget:
    """One target module's factors, ready for `y += lora_b @ (lora_a @ x)`.

    Attributes:
        lora_a: [r, in_features] float32.
        lora_b: [out_features, r] float32, already multiplied by the scale
            (alpha/r, or alpha/sqrt(r) for rsLoRA, as in PEFT's LoraLayer.update_layer).
        alpha: the alpha that applied to this module (after alpha_pattern).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    alpha: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    """A validated LoRA adapter.

    Attributes:
        name: registry name.
        rank: the largest rank over targets (a decoder slot must hold it); equals `r` unless
            rank_pattern varies it.
        alpha: the config's default `lora_alpha`.
        use_rslora: scale alpha/sqrt(r) instead of alpha/r.
        targets: module name (e.g. "model.layers.0.self_attn.q_proj") -> factors.
    """

    name: str
    rank: int
    alpha: float
    use_rslora: bool
    targets: dict[str, LoRATarget]

    @property
    def target_modules(self) -> list[str]:
        return sorted(self.targets)

    @property
    def digest(self) -> str:
        return adapter_digest(self.targets)


def adapter_digest(targets: dict[str, LoRATarget]) -> str:
    """sha256 hex over sorted target names, factor shapes and effective fp32 little-endian bytes.

    Only effective weights enter (B is scaled), so two names with identical effective weights
    share a digest and the decoder's prefix cache may share their KV; alpha or rank changes
    that alter the product change it.
    """
    digest = hashlib.sha256()
    for module in sorted(targets):
        target = targets[module]
        digest.update(module.encode() + b"\0")
        for tensor in (target.lora_a, target.lora_b):
            digest.update(("x".join(str(d) for d in tensor.shape) + ";").encode())
            array = tensor.detach().to(torch.float32).contiguous().numpy()
            digest.update(array.astype("<f4", copy=False).tobytes())
    return digest.hexdigest()


DRAINING = "draining"
# Listed states of a ready record that may not serve on the registry's base model: registered
# against another base, or before records named their base (it must be loaded again).
BASE_MISMATCH = "base_mismatch"
BASE_UNKNOWN = "base_unknown"


@dataclass(frozen=True)
class AdapterStatus:
    """A ready record with what decoders report: residency [(decoder id, leases taken as this
    name)], drain state, and base_state (BASE_MISMATCH / BASE_UNKNOWN when it may not serve on the
    registry's base model, else None)."""

    record: AdapterRecord
    residency: tuple[tuple[str, int], ...]
    draining: bool
    base_state: str | None = None

    @property
    def state(self) -> str:
        """The listed state: "ready", "draining", "base_mismatch" or "base_unknown"."""
        if self.base_state is not None:
            return self.base_state
        return DRAINING if self.draining else self.record.state

    @property
    def num_leases(self) -> int:
        return sum(n for _, n in self.residency)
