"""SmolLM3: the Llama block with RoPE skipped on the layers its config lists (NoPE layers).

As transformers' SmolLM3Attention: `no_rope_layers[i]` is 1 where layer i rotates q and k and 0
where it attends without positions; absent, every `no_rope_layer_interval`-th layer (1-based;
default 4) is a NoPE layer, as SmolLM3Config computes it. Sliding-window layers (`layer_types`,
which SmolLM3Config derives from `use_sliding_window` and `sliding_window` for the NoPE layers) are
refused. Family defaults are SmolLM3Config's: rope_theta 2e6, tied embeddings. Everything else
(q/k/v/o biases from `attention_bias`, `mlp_bias`, RMSNorm, SiLU) is model_llama.py.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from services.decoder.model_llama import LlamaAttention, LlamaForCausalLM, LlamaSpec

# SmolLM3Config's defaults where they differ from the Llama reading of config.json
DEFAULTS = {"rope_theta": 2_000_000.0, "tie_word_embeddings": True}


@dataclass(frozen=True)
class SmolLM3Spec(LlamaSpec):
    """LlamaSpec and `no_rope_layers`: per layer, 1 = RoPE, 0 = none."""

    no_rope_layers: tuple[int, ...] = ()


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


def _check_no_sliding_window(cfg: dict, flags: tuple[int, ...]) -> None:
    """Raises ValueError naming the sliding window and its layers where `layer_types` (given, or as
    SmolLM3Config derives it: the NoPE layers when use_sliding_window and sliding_window are set) has one."""
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        windowed = cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None
        layer_types = ["sliding_attention" if windowed and not rope else "full_attention" for rope in flags]
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if sliding:
        raise ValueError(f"sliding_window {cfg.get('sliding_window')!r} on SmolLM3 layers {sliding} is not "
                         "supported: the decoder serves full causal attention only for this family")


class SmolLM3Attention(LlamaAttention):
    def __init__(self, spec: SmolLM3Spec, layer: int) -> None:
        super().__init__(spec, layer)
        self.use_rope = bool(spec.no_rope_layers[layer])

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on a RoPE layer; on a NoPE layer q and k as projected, made contiguous as the
        rotation's outputs are (the attention kernels take a contiguous query)."""
        return super().rotate_qk(q, k, cos, sin) if self.use_rope else (q.contiguous(), k.contiguous())


class SmolLM3ForCausalLM(LlamaForCausalLM):
    attention_cls = SmolLM3Attention

    @classmethod
    def spec_from_config(cls, cfg: dict) -> SmolLM3Spec:
        """Raises ValueError for sliding-window layers, malformed no_rope_layers, or what
        LlamaSpec refuses."""
        cfg = {**DEFAULTS, **cfg}
        flags = no_rope_layers(cfg)
        _check_no_sliding_window(cfg, flags)
        # the window is checked above; use_sliding_window with no window set leaves every layer full
        base = LlamaSpec.from_config({k: v for k, v in cfg.items() if k not in ("use_sliding_window", "layer_types")})
        values = {f.name: getattr(base, f.name) for f in fields(LlamaSpec)}
        values["architecture"] = (cfg.get("architectures") or ["SmolLM3ForCausalLM"])[0]
        return SmolLM3Spec(**values, no_rope_layers=flags)
