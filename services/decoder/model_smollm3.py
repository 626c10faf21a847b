"""SmolLM3: the Llama block with RoPE skipped on the layers its config lists (NoPE layers), and
sliding-window attention on the layers `layer_types` names.

As transformers' SmolLM3Attention: `no_rope_layers[i]` is 1 where layer i rotates q and k and 0
where it attends without positions; absent, every `no_rope_layer_interval`-th layer (1-based;
default 4) is a NoPE layer, as SmolLM3Config computes it. `layer_types` (absent: SmolLM3Config
makes the NoPE layers "sliding_attention" when `use_sliding_window` and `sliding_window` are set)
gives each "sliding_attention" layer a window of `sliding_window` keys, as transformers'
SmolLM3Model masks them (`create_sliding_window_causal_mask`: keys p - sliding_window < kv <= p).
Family defaults are SmolLM3Config's: rope_theta 2e6, tied embeddings. Everything else (q/k/v/o
biases from `attention_bias`, `mlp_bias`, RMSNorm, SiLU, the C kernels) is model_llama.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.decoder.model_llama import LlamaAttention, LlamaForCausalLM, LlamaSpec

# SmolLM3Config's defaults where they differ from the Llama reading of config.json
DEFAULTS = {"rope_theta": 2_000_000.0, "tie_word_embeddings": True}
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclass(frozen=True)
class SmolLM3Spec(LlamaSpec):
    """LlamaSpec and, per layer, `no_rope_layers` (1 = RoPE, 0 = none) and `layer_types`
    (SLIDING layers attend within `sliding_window` keys, themselves included)."""

    no_rope_layers: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None


def no_rope_layers(cfg: dict) -> tuple[int, ...]:
    """config.json's `no_rope_layers`, or SmolLM3Config's derivation from `no_rope_layer_interval`.

    Raises:
        ValueError: a list whose length is not num_hidden_layers or whose entries are not 0/1, or an
            interval that is not a positive integer.
    """
    num_layers = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"config.json's no_rope_layer_interval must be a positive integer, got {interval!r}")
        return tuple(int((i + 1) % interval != 0) for i in range(num_layers))
    if not isinstance(flags, list) or len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"config.json's no_rope_layers must list 0 or 1 for each of the {num_layers} layers, "
                         f"got {flags!r}")
    return tuple(int(f) for f in flags)


def layer_types(cfg: dict, flags: tuple[int, ...]) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window): config.json's, or SmolLM3Config's derivation (the NoPE layers
    slide when use_sliding_window and sliding_window are set); the window is None without sliding layers.

    Raises:
        ValueError: layer_types that are not one of SLIDING / FULL per layer, or sliding layers with a
            sliding_window that is not a positive integer (transformers' mask needs one).
    """
    window = cfg.get("sliding_window")
    kinds = cfg.get("layer_types")
    if kinds is None:
        windowed = bool(cfg.get("use_sliding_window")) and window is not None
        kinds = [SLIDING if windowed and not rope else FULL for rope in flags]
    if not isinstance(kinds, list) or len(kinds) != len(flags) or any(k not in (SLIDING, FULL) for k in kinds):
        raise ValueError(f"config.json's layer_types must name {SLIDING!r} or {FULL!r} for each of the "
                         f"{len(flags)} layers, got {kinds!r}")
    if SLIDING not in kinds:
        return tuple(kinds), None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json's sliding_window must be a positive integer for the sliding_attention "
                         f"layers {[i for i, k in enumerate(kinds) if k == SLIDING]}, got {window!r}")
    return tuple(kinds), window


class SmolLM3Attention(LlamaAttention):
    def __init__(self, spec: SmolLM3Spec, layer: int) -> None:
        super().__init__(spec, layer)
        self.use_rope = bool(spec.no_rope_layers[layer])
        self.sliding_window = spec.sliding_window if spec.layer_types[layer] == SLIDING else None

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on a RoPE layer; on a NoPE layer q and k as projected, made contiguous as the
        rotation's outputs are (the attention kernels take a contiguous query)."""
        return super().rotate_qk(q, k, cos, sin) if self.use_rope else (q.contiguous(), k.contiguous())


class SmolLM3ForCausalLM(LlamaForCausalLM):
    attention_cls = SmolLM3Attention

    @classmethod
    def spec_from_config(cls, cfg: dict) -> SmolLM3Spec:
        """Raises ValueError for malformed no_rope_layers, layer_types or sliding_window, or what
        LlamaSpec refuses."""
        cfg = {**DEFAULTS, **cfg}
        flags = no_rope_layers(cfg)
        kinds, window = layer_types(cfg, flags)
        # the windows are read above; LlamaSpec refuses sliding layers of its own
        base = LlamaSpec.from_config({k: v for k, v in cfg.items() if k not in ("use_sliding_window", "layer_types")})
        return base.extended(SmolLM3Spec, architecture=(cfg.get("architectures") or ["SmolLM3ForCausalLM"])[0],
                             no_rope_layers=flags, layer_types=kinds, sliding_window=window)
