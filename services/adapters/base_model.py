"""Linear-module shapes of a Llama-family base model, read from its config.json, and the scale
(largest |weight|) of each linear, read from its safetensors when the directory holds them.

A mixture-of-experts model's routed experts are LoRA targets one by one (PEFT's `target_parameters`
on transformers 5's 3-D expert weights, read per expert by peft_format.py): expert e of layer i is
`model.layers.{i}.mlp.experts.{e}.gate_up_proj` (hidden -> 2 * expert size, gate rows then up rows)
and `...{e}.down_proj` (expert size -> hidden), as services/decoder/moe.py computes them; the router
is `model.layers.{i}.mlp.gate` (hidden -> experts)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from services.common.checkpoint import QUANTIZATION_METADATA, CheckpointConfig, moe_layout
from services.common.lora_names import EXPERT_PARTS, expert_target

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LinearShape:
    in_features: int
    out_features: int


@dataclass(frozen=True)
class BaseModelShapes:
    """module name -> (in_features, out_features) for every LoRA-targetable linear.

    Names follow transformers' Llama layout: `model.layers.{i}.self_attn.{q,k,v,o}_proj` and
    `model.layers.{i}.mlp.{gate,up,down}_proj` on dense layers; on a MoE model's sparse layers
    `mlp.experts.{e}.{gate_up,down}_proj` and `mlp.gate` (module docstring) and `mlp.shared_expert.*` where
    config.json has a `shared_expert_intermediate_size`; head_dim defaults to hidden_size /
    num_attention_heads as in LlamaConfig.
    """

    modules: dict[str, LinearShape]
    weight_files: tuple[Path, ...] = ()
    model_type: str = ""  # config.json's (the text model's for a VLM)
    _scales: dict[str, float | None] = field(default_factory=dict, compare=False, repr=False)
    _key_to_file: dict[str, Path] = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def weight_scale(self, module: str) -> float | None:
        """max |W| (float) of `module`'s base weight, read once and cached; None when the model
        directory holds no safetensors or none of them names this module's weight.

        VL checkpoints name text weights `model.language_model.layers...` in newer layouts; both
        spellings are looked up.
        """
        with self._lock:
            if module not in self._scales:
                self._scales[module] = self._read_scale(module)
            return self._scales[module]

    def _read_scale(self, module: str) -> float | None:
        if not self._key_to_file:
            for path in self.weight_files:
                try:
                    with safe_open(str(path), "pt") as reader:
                        self._key_to_file.update((key, path) for key in reader.keys())  # noqa: SIM118 (safe_open is not a dict)
                except (SafetensorError, OSError):
                    continue
        expert = expert_target(module)
        if expert is not None:
            return self._expert_scale(*expert)
        suffix = module.removeprefix("model.")
        for key in (f"{module}.weight", f"model.language_model.{suffix}.weight"):
            weight = self._tensor(key)
            if weight is not None:
                return float(weight.abs().max()) if weight.numel() else None
        return None

    def _expert_scale(self, part: str, expert: int) -> float | None:
        """max |W| of one routed expert's part "<layer>.mlp.experts.<gate_up_proj|down_proj>": from
        the stacked 3-D weight, or from the per-expert weights save_pretrained writes (Qwen's
        gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2 under `block_sparse_moe`)."""
        group, name = part.rsplit(".", 1)
        stacked = self._tensor(part)
        if stacked is not None:
            return float(stacked[expert].abs().max())
        layer = group.removesuffix(".mlp.experts")
        names = {"gate_up_proj": (("gate_proj", "w1"), ("up_proj", "w3")), "down_proj": (("down_proj", "w2"),)}[name]
        scales = []
        for qwen, mixtral in names:
            weight = self._tensor(f"{group}.{expert}.{qwen}.weight")
            if weight is None:
                weight = self._tensor(f"{layer}.block_sparse_moe.experts.{expert}.{mixtral}.weight")
            if weight is None:
                return None
            scales.append(float(weight.abs().max()))
        return max(scales)

    def _tensor(self, key: str) -> torch.Tensor | None:
        """The float32 values of tensor `key` of the model's safetensors (GGUF blocks dequantized);
        None when no file holds it."""
        path = self._key_to_file.get(key)
        if path is None:
            return None
        with safe_open(str(path), "pt") as reader:
            weight = reader.get_tensor(key)
            qtype = json.loads((reader.metadata() or {}).get(QUANTIZATION_METADATA, "{}")).get(key)
        if qtype is not None:  # GGUF blocks (models import --keep-quantized): their values
            import gguf

            weight = torch.from_numpy(gguf.quants.dequantize(weight.numpy(), gguf.GGMLQuantizationType[qtype]))
        return weight.to(torch.float32)

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> BaseModelShapes:
        """Raises ValueError when config.json lacks a field the layout needs."""
        config = CheckpointConfig.read(model_dir)
        required = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
        missing = [name for name in required if getattr(config, name) is None]
        if missing:
            raise ValueError(f"base model config.json in {model_dir} lacks {missing[0]!r}")
        hidden, intermediate = config.hidden_size, config.intermediate_size
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        num_layers, head_dim = config.num_hidden_layers, config.head_dim
        per_layer = {
            "self_attn.q_proj": LinearShape(hidden, num_heads * head_dim),
            "self_attn.k_proj": LinearShape(hidden, num_kv_heads * head_dim),
            "self_attn.v_proj": LinearShape(hidden, num_kv_heads * head_dim),
            "self_attn.o_proj": LinearShape(num_heads * head_dim, hidden),
            "mlp.gate_proj": LinearShape(hidden, intermediate),
            "mlp.up_proj": LinearShape(hidden, intermediate),
            "mlp.down_proj": LinearShape(intermediate, hidden),
        }
        text = config.raw.get("text_config") or config.raw
        moe = moe_layout(text, num_layers, intermediate)
        sparse = {}
        if moe is not None:  # a sparse layer's routed experts (and Qwen2-MoE's shared expert) replace the MLP
            inter = moe.moe_intermediate_size
            expert_shapes = {"gate_up_proj": LinearShape(hidden, 2 * inter), "down_proj": LinearShape(inter, hidden)}
            sparse = {f"mlp.experts.{e}.{part}": expert_shapes[part]
                      for e in range(moe.num_experts) for part in EXPERT_PARTS}
            sparse["mlp.gate"] = LinearShape(hidden, moe.num_experts)  # the router (target_parameters "gate.weight")
            shared = text.get("shared_expert_intermediate_size")
            if shared:
                sparse.update({"mlp.shared_expert.gate_proj": LinearShape(hidden, shared),
                               "mlp.shared_expert.up_proj": LinearShape(hidden, shared),
                               "mlp.shared_expert.down_proj": LinearShape(shared, hidden),
                               "mlp.shared_expert_gate": LinearShape(hidden, 1)})
        modules = {}
        for i in range(num_layers):
            layer = per_layer if moe is None or i not in moe.sparse_layers else {
                suffix: shape for suffix, shape in per_layer.items() if suffix.startswith("self_attn.")} | sparse
            modules.update({f"model.layers.{i}.{suffix}": shape for suffix, shape in layer.items()})
        return cls(modules, tuple(sorted(Path(model_dir).glob("*.safetensors"))), text.get("model_type") or "")
