"""Qwen2: the Llama block with biases on the q/k/v projections and none on o_proj.

As transformers' Qwen2Attention (`bias=True` on q_proj, k_proj, v_proj; `bias=False` on o_proj;
the config has no `attention_bias` field; the MLP has no bias). With `use_sliding_window` the layers
`qwen_layer_windows` names attend within `sliding_window` (Qwen2Config's reading, shared by Qwen3).
Everything else is model_llama.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.decoder.model_llama import LlamaForCausalLM, LlamaSpec

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclass(frozen=True)
class QwenSpec(LlamaSpec):
    """LlamaSpec and each layer's sliding window (None: full causal attention; () : none windowed)."""

    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_config(cls, cfg: dict) -> QwenSpec:
        """LlamaSpec's reading of config.json and `qwen_layer_windows`.

        Raises:
            ValueError: what LlamaSpec or `qwen_layer_windows` refuses.
        """
        windows = qwen_layer_windows(cfg)
        llama_cfg = {k: v for k, v in cfg.items() if k not in ("use_sliding_window", "layer_types")}
        base = LlamaSpec.from_config(llama_cfg)
        return base.extended(cls, layer_windows=windows)


def qwen_layer_windows(cfg: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers' Qwen2Config / Qwen3Config read config.json:
    `sliding_window` (default 4096) only with `use_sliding_window`; a layer of `layer_types` (default:
    "sliding_attention" for layers >= `max_window_layers`, default 28) attends within it.

    Raises:
        ValueError: a sliding_window that is not a positive integer, or layer_types that are not one
            of "sliding_attention" / "full_attention" per layer.
    """
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    types = cfg.get("layer_types") or [SLIDING if window is not None and i >= cfg.get("max_window_layers", 28)
                                       else FULL for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"layer_types must name {SLIDING!r} or {FULL!r} for each of the {num_layers} layers, "
                         f"got {types!r}")
    return tuple(window if kind == SLIDING else None for kind in types)


def set_layer_windows(model: LlamaForCausalLM, spec: LlamaSpec) -> None:
    """Give each layer's attention its window from a QwenSpec (a plain LlamaSpec windows none)."""
    for layer, window in zip(model.model.layers, getattr(spec, "layer_windows", ())):
        layer.self_attn.sliding_window = window


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec_from_config(cls, cfg: dict) -> QwenSpec:
        spec = QwenSpec.from_config(cfg)
        architecture = (cfg.get("architectures") or ["Qwen2ForCausalLM"])[0]
        return replace(spec, architecture=architecture, qkv_bias=True, o_bias=False, mlp_bias=False)

    def __init__(self, spec: LlamaSpec, mrope_section: tuple[int, int, int] | None = None) -> None:
        super().__init__(spec, mrope_section)
        set_layer_windows(self, spec)
