"""Mistral: the Llama block with sliding-window attention on every layer.

As transformers' MistralForCausalLM: no biases, SiLU MLP, `head_dim` from config.json (else
hidden_size / heads), and every layer attends with config.json's `sliding_window` (None: full causal
attention), a query at position p seeing keys p - sliding_window < kv <= p (masking_utils'
`sliding_window_overlay`). MistralConfig takes no `layer_types`: given some, transformers 5 warns
("consider the Ministral classes") and its masks then follow the cache's per-layer types, not the
Mistral attention's window, so such a config.json is refused. With every layer windowed the scheduler frees a running
request's KV blocks that lie wholly before its window (`model_sliding_window`).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.decoder.model_llama import LlamaAttention, LlamaForCausalLM, LlamaSpec, positive_or_none


@dataclass(frozen=True)
class MistralSpec(LlamaSpec):
    """LlamaSpec and the window every layer attends with (None: full causal attention)."""

    sliding_window: int | None = None

    @classmethod
    def from_config(cls, cfg: dict) -> MistralSpec:
        """Mistral's reading of config.json.

        Raises:
            ValueError: what LlamaSpec refuses, a `sliding_window` that is not a positive integer, or
                `layer_types` (see the module docstring).
        """
        if cfg.get("layer_types") is not None:
            raise ValueError("config.json's layer_types is not a MistralConfig field (transformers warns and mixes "
                             "per-layer cache types with Mistral's one window); Ministral checkpoints are not served")
        window = positive_or_none("sliding_window", cfg.get("sliding_window"), integer=True)
        llama_cfg = dict(cfg)
        llama_cfg.setdefault("architectures", ["MistralForCausalLM"])
        base = LlamaSpec.from_config(llama_cfg)
        return base.extended(cls, sliding_window=window)


class MistralAttention(LlamaAttention):
    def __init__(self, spec: MistralSpec, layer: int) -> None:
        super().__init__(spec, layer)
        self.sliding_window = spec.sliding_window


class MistralForCausalLM(LlamaForCausalLM):
    attention_cls = MistralAttention

    @classmethod
    def spec_from_config(cls, cfg: dict) -> MistralSpec:
        return MistralSpec.from_config(cfg)
