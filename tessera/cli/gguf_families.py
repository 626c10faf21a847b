"""What llama.cpp's `convert_hf_to_gguf.py` writes for each Hugging Face family `export-gguf` covers.

One `GgufFamily` per config.json `model_type`: the GGUF architecture, the family-specific metadata
beside the common keys, and how a checkpoint tensor becomes the file's (q/k permuted for the llama
architecture, Gemma's RMSNorm weights stored as 1 + w, MoE experts stacked per layer). The
converter's classes are named in each entry (LlamaModel, Qwen2Model, Gemma2Model, ...).

RoPE scaling goes where the format has room for it: `{arch}.rope.scaling.*` for linear, yarn and
longrope, Llama 3's per-frequency divisors as the `rope_freqs.weight` tensor
(`LlamaModel.generate_extra_tensors`), longrope's as `rope_factors_short/long.weight` (Phi3MiniModel).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import gguf
    import torch

# the RoPE types written (llama3 as the rope_freqs tensor, longrope's factors as rope_factors_short/long);
# dynamic has no key in llama.cpp's format
EXPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "longrope")


@dataclass(frozen=True)
class GgufFamily:
    """How one model_type is written.

    Attributes:
        arch: gguf's MODEL_ARCH member name ("LLAMA", "QWEN2", ...).
        permute_qk: q/k rows go from rotate-half to GGML's interleaved pairs (llama arch only).
        norm_offset: added to every `*norm.weight` (Gemma's RMSNorm computes x * (1 + w); llama.cpp x * w).
        extra_hparams: writes the family's own metadata from config.json (softcaps, expert sizes).
        tied_output: the family never writes `output.weight` (Gemma 2's head is its embeddings).
        window_key: the family's GGUF carries a sliding window (`{arch}.attention.sliding_window`);
            without one, llama.cpp runs every layer over the whole context.
    """

    arch: str
    permute_qk: bool = False
    norm_offset: float = 0.0
    extra_hparams: Callable[[gguf.GGUFWriter, dict], None] = field(default=lambda writer, config: None)
    tied_output: bool = False
    window_key: bool = False


def _gemma2(writer: gguf.GGUFWriter, config: dict) -> None:
    """Gemma2Model.set_gguf_parameters: both soft-caps and the local window."""
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])


def _gemma3(writer: gguf.GGUFWriter, config: dict) -> None:
    """Gemma3Model.set_gguf_parameters: the final soft-cap when set, the local window, the local RoPE base."""
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_theta") is not None:
        writer.add_rope_freq_base_swa(float(local["rope_theta"]))


def _phi3(writer: gguf.GGUFWriter, config: dict) -> None:
    """Phi3MiniModel.set_gguf_parameters: the rotary width (partial rotary) and the window when set."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    factor = (config.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                         config.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(int(factor * head_dim))
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])


def _moe(writer: gguf.GGUFWriter, config: dict) -> None:
    """Qwen2MoeModel.set_gguf_parameters: the experts' and the shared expert's widths."""
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


GGUF_FAMILIES: dict[str, GgufFamily] = {
    "llama": GgufFamily("LLAMA", permute_qk=True),
    "mistral": GgufFamily("LLAMA", permute_qk=True),  # LlamaModel: llama.cpp runs Mistral as llama
    "qwen2": GgufFamily("QWEN2"),
    "qwen3": GgufFamily("QWEN3"),
    "gemma2": GgufFamily("GEMMA2", norm_offset=1.0, extra_hparams=_gemma2, tied_output=True, window_key=True),
    "gemma3_text": GgufFamily("GEMMA3", norm_offset=1.0, extra_hparams=_gemma3, window_key=True),
    "phi3": GgufFamily("PHI3", extra_hparams=_phi3, window_key=True),
    "qwen2_moe": GgufFamily("QWEN2MOE", extra_hparams=_moe),
    "qwen3_moe": GgufFamily("QWEN3MOE", extra_hparams=_moe),
}


# the families whose transformers model reads sliding_window (Llama's ignores one in its config.json);
# of them, those that slide only the layers layer_types marks "sliding_attention" (Qwen2, Qwen3: from
# max_window_layers on, Qwen2-MoE: even layers below it; none without use_sliding_window) -- Mistral and
# Qwen3-MoE slide every layer once sliding_window is set
_SLIDING_MODEL_TYPES = ("mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_WINDOW_BY_LAYER_TYPE = ("qwen2", "qwen3", "qwen2_moe")


def unkeyed_sliding_window(family: GgufFamily, hf_config) -> int | None:
    """The sliding window transformers gives some of the checkpoint's layers (`hf_config`: its
    PretrainedConfig, defaults filled in) when it is narrower than `max_position_embeddings` and the
    family's GGUF has no key for it; None where the file computes what the checkpoint does (the format
    writes the window, or every layer attends to the whole context: no window, one at least the context,
    no layer marked sliding)."""
    if family.window_key or hf_config.model_type not in _SLIDING_MODEL_TYPES:
        return None
    window = getattr(hf_config, "sliding_window", None)
    if not window or window >= hf_config.max_position_embeddings:
        return None
    if (hf_config.model_type in _WINDOW_BY_LAYER_TYPE
            and "sliding_attention" not in (getattr(hf_config, "layer_types", None) or ())):
        return None
    return window


def add_rope_scaling(writer: gguf.GGUFWriter, rope: dict, max_position_embeddings: int) -> None:
    """TextModel.set_gguf_parameters' RoPE scaling keys for linear and yarn, Phi3MiniModel's for longrope
    (its factors are tensors: `rope_tensors`, as llama3's). `rope`: the full-attention layers' rope_parameters."""
    import gguf

    rope_type = rope.get("rope_type", "default")
    if rope_type == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = max_position_embeddings / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(rope.get("attention_factor") or default)
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def llama3_rope_factors(rope: dict, head_dim: int) -> torch.Tensor:
    """The `rope_freqs.weight` tensor [head_dim / 2] float32 of a llama3-scaled RoPE: the divisor of each
    inverse frequency (1 above the high-frequency wavelength, `factor` below the low one, smoothed
    between), as `LlamaModel.generate_extra_tensors` computes it from transformers' llama3 parameters."""
    import torch

    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def rope_tensors(rope: dict, head_dim: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The RoPE factor tensors of llama3 (`rope_freqs.weight`) and longrope (`rope_factors_short.weight`,
    `rope_factors_long.weight`), float32, [rotary dims / 2]; nothing for the other types."""
    import torch

    if rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", llama3_rope_factors(rope, head_dim)
    elif rope.get("rope_type") == "longrope":
        yield "rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32)
        yield "rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32)


_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_GATE_UP = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj$")


def family_tensors(family: GgufFamily, config: dict, tensors: Iterator[tuple[str, torch.Tensor]],
                   name_map: gguf.TensorNameMap) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, float32 tensor) for each checkpoint tensor (`tensors`: HF name, tensor), in the
    converter's layout: q/k permuted (llama arch), norms offset (Gemma), a tied or Gemma 2 head
    dropped, MoE experts stacked into `blk.N.ffn_{gate,up,down}_exps` [experts, out, in] (from the
    hub's per-expert tensors or transformers' fused `experts.gate_up_proj`), the shared expert's gate
    [1, hidden] as [hidden].

    Raises:
        ValueError: a tensor gguf's name map does not know (the name given), or an untied head of a
            family whose GGUF has none (Gemma 2).
    """
    import torch

    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for hf_name, data in tensors:
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if hf_name == "lm_head.weight" and family.tied_output:
            raise ValueError(f"{family.arch} has no output tensor in GGUF, and this lm_head is not tied")
        data = data.to(torch.float32)
        if match := _EXPERT.match(hf_name):
            experts.setdefault((int(match[2]), match[4]), {})[int(match[3])] = data
            continue
        if match := _FUSED_GATE_UP.match(hf_name):  # [experts, 2 * moe_intermediate, hidden]: gate rows first
            gate, up = data.chunk(2, dim=1)
            yield f"blk.{match[1]}.ffn_gate_exps.weight", gate.contiguous()
            yield f"blk.{match[1]}.ffn_up_exps.weight", up.contiguous()
            continue
        if family.permute_qk and hf_name.endswith("q_proj.weight"):
            data = permute_for_ggml(data, num_heads)
        elif family.permute_qk and hf_name.endswith("k_proj.weight"):
            data = permute_for_ggml(data, num_kv_heads)
        if family.norm_offset and hf_name.endswith("norm.weight"):
            data = data + family.norm_offset
        if hf_name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for tensor {hf_name!r}")
        yield name, data
    for (layer, projection), by_expert in sorted(experts.items()):
        yield f"blk.{layer}.ffn_{projection}_exps.weight", torch.stack([by_expert[e] for e in sorted(by_expert)])


def permute_for_ggml(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[heads * head_dim, hidden] rows from rotate-half pairs (i, i + d/2) to adjacent pairs (2i, 2i + 1).

    llama.cpp's `LlamaModel.permute`:

        head rows  [x0 x1 .. x(d/2-1) | y0 y1 .. y(d/2-1)]  ->  [x0 y0 x1 y1 ..]
    """
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))
