"""A GGUF file (llama.cpp's converter, Ollama) read into a Hugging Face checkpoint directory.

transformers reads the file (`from_pretrained(..., gguf_file=...)`: its GGUF config mapping, tensor
renaming, q/k un-permutation, Gemma's norm offset, MoE expert merging, dequantization, tokenizer).
What its reader drops, the `gguf` package reads from the same file and `gguf_config` adds to
transformers' config before the model is built, each as the inverse of what
`convert_hf_to_gguf.py` writes:

- head and expert widths: `{arch}.attention.key_length` -> head_dim, `expert_feed_forward_length`
  -> moe_intermediate_size, `expert_shared_feed_forward_length` -> shared_expert_intermediate_size;
- Gemma's `attn_logit_softcapping` / `final_logit_softcapping`, Gemma 3's local RoPE base
  (`rope.freq_base_swa`), Gemma's query scale (not in the file: llama.cpp's, 1 / sqrt(head_dim),
  1 / sqrt(hidden / heads) for the 27B models), Phi-3's rotary width (`rope.dimension_count` ->
  partial_rotary_factor);
- RoPE scaling: `rope.scaling.type` linear / yarn (factor, original context, yarn's attention
  factor and betas) / longrope (`rope_factors_short` / `rope_factors_long` tensors); Llama 3's
  `rope_freqs.weight` divisors back to transformers' llama3 parameters (`llama3_parameters`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.errors import InvalidArgument

if TYPE_CHECKING:
    import numpy as np
    from transformers import PretrainedConfig

# llama.cpp writes llama3's divisors from these transformers defaults (LlamaModel.generate_extra_tensors);
# any (low, high, original) with the same wavelength bounds gives the same frequencies
LLAMA3_ORIGINAL_CONTEXT = 8192
# GGML types tessera's decoder serves as stored (services/decoder/quant.py), `models import --keep-quantized`
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# architecture -> the layer count by which llama.cpp knows a 27B Gemma (its query scale differs)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@dataclass(frozen=True)
class GgufSource:
    """What `tessera models list` shows of a GGUF an import came from.

    Attributes:
        file: the file's name.
        architecture: `general.architecture` ("llama", "qwen2", "gemma3", ...).
        file_type: the weights' type, "Q4_1", "Q8_0", "F16", "BF16", "F32", ... (`general.file_type`,
            else the type most matrix elements have).
    """

    file: str
    architecture: str
    file_type: str

    def to_json(self) -> dict[str, str]:
        return {"format": "gguf", "file": self.file, "architecture": self.architecture, "file_type": self.file_type}


@dataclass(frozen=True)
class GgufMetadata:
    """One read of a GGUF's header: what the import takes from the file beside transformers.

    Attributes:
        fields: every metadata key -> its value (a scalar, a string or a list; the tokenizer's lists
            left out: transformers reads those).
        rope_tensors: `rope_freqs.weight`, `rope_factors_short/long.weight` -> float64 values.
        matrix_types: GGML type name -> element count, over the tensors of 2 or more dimensions.
    """

    fields: dict[str, Any]
    rope_tensors: dict[str, np.ndarray]
    matrix_types: Counter

    @classmethod
    def read(cls, path: Path) -> GgufMetadata:
        """Reads the header and the RoPE tensors only (the file is memory-mapped)."""
        import gguf
        import numpy as np

        reader = gguf.GGUFReader(path)
        fields = {key: field.contents() for key, field in reader.fields.items()
                  if not key.startswith("tokenizer.ggml.") or key == "tokenizer.ggml.model"}
        rope_tensors = {t.name: np.asarray(t.data, dtype=np.float64).reshape(-1) for t in reader.tensors
                        if t.name.startswith(("rope_freqs", "rope_factors"))}
        matrix_types = Counter()
        for tensor in reader.tensors:
            if len(tensor.shape) >= 2:
                matrix_types[tensor.tensor_type.name] += int(tensor.n_elements)
        return cls(fields=fields, rope_tensors=rope_tensors, matrix_types=matrix_types)

    def source(self, file: str) -> GgufSource:
        """The GgufSource of this file, named `file`."""
        import gguf

        try:
            file_type = gguf.LlamaFileType(self.fields.get("general.file_type")).name
            file_type = file_type.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            file_type = self.matrix_types.most_common(1)[0][0] if self.matrix_types else "?"
        return GgufSource(file=file, architecture=str(self.fields.get("general.architecture", "?")),
                          file_type=file_type)


def gguf_config(path: Path, metadata: GgufMetadata | None = None) -> PretrainedConfig:
    """transformers' config for the GGUF at `path`, with the fields its reader drops filled in from
    the file (see the module docstring); `metadata`: the file's, when already read.

    Raises:
        InvalidArgument: transformers cannot read the file's config, or its RoPE frequencies fit no
            RoPE type transformers computes (the tensor named).
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, OSError, KeyError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise InvalidArgument(f"{str(path)!r}: transformers cannot load this GGUF: {first}") from None
    metadata = metadata or GgufMetadata.read(path)
    values = config.to_dict()
    arch = metadata.fields["general.architecture"]
    try:
        _add_stated_fields(values, metadata.fields, arch)
        _add_rope_scaling(values, metadata.fields, metadata.rope_tensors, arch)
    except ValueError as error:
        raise InvalidArgument(f"{str(path)!r}: {error}") from None
    values.pop("_model_name_or_path", None)  # general.name, not a config field
    _shortest_float32(values)
    return type(config).from_dict(values)


def _shortest_float32(values: dict) -> None:
    """Floats the file holds as float32 (9.99999997e-07) written as the shortest decimal of that
    float32 (1e-06), the number config.json had before conversion; nested dicts too."""
    import numpy as np

    for key, value in values.items():
        if isinstance(value, dict):
            _shortest_float32(value)
        elif isinstance(value, float) and math.isfinite(value) and float(np.float32(value)) == value:
            values[key] = float(str(np.float32(value)))


def _add_stated_fields(values: dict, fields: dict, arch: str) -> None:
    """Widths, soft-caps, windows and the rotary width the file states, onto `values` (config.to_dict())."""
    stated = {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size",
              "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
              "attn_logit_softcapping": "attn_logit_softcapping",
              "final_logit_softcapping": "final_logit_softcapping", "attention.sliding_window": "sliding_window"}
    for key, name in stated.items():
        if f"{arch}.{key}" in fields and name in values:
            values[name] = fields[f"{arch}.{key}"]
    if arch in GEMMA_27B_LAYERS and "query_pre_attn_scalar" in values:
        # not in the file: llama.cpp scales queries by 1 / sqrt(head_dim), by 1 / sqrt(hidden / heads) for 27B
        big = fields.get(f"{arch}.block_count") == GEMMA_27B_LAYERS[arch]
        values["query_pre_attn_scalar"] = (values["hidden_size"] // values["num_attention_heads"] if big
                                           else values["head_dim"])
    rope = values.get("rope_parameters") or {}
    if f"{arch}.rope.freq_base_swa" in fields and "sliding_attention" in rope:
        rope["sliding_attention"]["rope_theta"] = float(fields[f"{arch}.rope.freq_base_swa"])
    if arch == "phi3" and f"{arch}.rope.dimension_count" in fields:
        head_dim = values["hidden_size"] // values["num_attention_heads"]
        factor = fields[f"{arch}.rope.dimension_count"] / head_dim
        if factor != 1.0:
            values["partial_rotary_factor"] = factor
            rope["partial_rotary_factor"] = factor


def _add_rope_scaling(values: dict, fields: dict, tensors: dict[str, np.ndarray], arch: str) -> None:
    """`rope.scaling.*` keys and the RoPE factor tensors, as transformers' rope_parameters of the
    full-attention layers (Gemma 3 keys its parameters by layer type)."""
    rope = values.get("rope_parameters")
    if rope is None:
        return
    target = rope.get("full_attention", rope)
    key = lambda name: fields.get(f"{arch}.rope.scaling.{name}")  # noqa: E731
    scaling = key("type")
    if scaling == "linear":
        target.update(rope_type="linear", factor=float(key("factor")))
    elif scaling == "yarn":
        target.update(rope_type="yarn", factor=float(key("factor")),
                      original_max_position_embeddings=int(key("original_context_length")))
        for name, hf_name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                              ("yarn_beta_slow", "beta_slow")):
            if key(name) is not None:
                target[hf_name] = float(key(name))
    elif scaling == "longrope" or "rope_factors_long.weight" in tensors:
        target.update(rope_type="longrope",
                      short_factor=tensors["rope_factors_short.weight"].tolist(),
                      long_factor=tensors["rope_factors_long.weight"].tolist(),
                      original_max_position_embeddings=int(key("original_context_length")))
        values["original_max_position_embeddings"] = target["original_max_position_embeddings"]
        attn_factor = key("attn_factor")
        scale = values["max_position_embeddings"] / target["original_max_position_embeddings"]
        default = math.sqrt(1 + math.log(scale) / math.log(target["original_max_position_embeddings"])) \
            if scale > 1 else 1.0
        if attn_factor is not None and not math.isclose(attn_factor, default, rel_tol=1e-6):
            target["attention_factor"] = float(attn_factor)
    elif "rope_freqs.weight" in tensors:
        head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
        parameters = llama3_parameters(tensors["rope_freqs.weight"], target["rope_theta"], head_dim)
        if parameters is not None:
            target.update(parameters)


def llama3_parameters(divisors: np.ndarray, rope_theta: float, head_dim: int) -> dict | None:
    """transformers' llama3 rope_parameters giving `divisors` (the file's `rope_freqs.weight`, one per
    frequency: 1 at high frequencies, `factor` at low ones, smoothed between), or None when every
    divisor is 1 (plain RoPE).

    The divisors fix `factor` and the two wavelength bounds, original / high_freq_factor and
    original / low_freq_factor, not the three numbers apart: the original context is taken as 8192
    (the converter's default) and the factors solved for; with fewer than two smoothed frequencies
    the bounds are placed inside the gaps the divisors leave.

    Raises:
        ValueError: no llama3 parameters reproduce the divisors (to 1e-4), naming `rope_freqs.weight`.
    """
    import numpy as np

    factor = float(divisors.max())
    if np.allclose(divisors, 1.0):
        return None
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    original = LLAMA3_ORIGINAL_CONTEXT
    candidates = [(1.0, 4.0)]  # Llama 3.1 / 3.2 / 3.3
    high = divisors <= 1 + 1e-6
    low = divisors >= factor * (1 - 1e-6)
    medium = ~high & ~low
    # smooth = (original / wavelen - low_f) / (high_f - low_f) is linear in 1 / wavelen
    smooth = (1 / divisors - 1 / factor) / (1 - 1 / factor)
    x = 1 / wavelen
    if medium.sum() >= 2:
        slope, intercept = np.polyfit(x[medium], smooth[medium], 1)
        candidates.append((-intercept * original / slope, (1 - intercept) * original / slope))
    else:  # bounds in 1 / wavelen: high-frequency bound p above every medium x, low bound q below
        x_high = x[high].min() if high.any() else x.max() * 2
        x_low = x[low].max() if low.any() else 0.0
        if medium.any():
            x_mid, s = float(x[medium][0]), float(smooth[medium][0])
            p = x_mid + min((x_high - x_mid) / 2, (1 - s) * (x_mid - x_low) / (2 * s))
            q = (x_mid - s * p) / (1 - s)
        else:
            p, q = x_low + (x_high - x_low) * 2 / 3, x_low + (x_high - x_low) / 3
        candidates.append((q * original, p * original))
    for low_freq_factor, high_freq_factor in candidates:
        parameters = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low_freq_factor),
                      "high_freq_factor": float(high_freq_factor), "original_max_position_embeddings": original}
        if np.allclose(_llama3_divisors(parameters, wavelen), divisors, rtol=1e-4, atol=0):
            return parameters
    raise ValueError("its rope_freqs.weight divisors fit no llama3 RoPE parameters")


def _llama3_divisors(parameters: dict, wavelen: np.ndarray) -> np.ndarray:
    """The divisor of each frequency under llama3 `parameters`, as transformers' _compute_llama3_parameters."""
    import numpy as np

    factor, original = parameters["factor"], parameters["original_max_position_embeddings"]
    low, high = parameters["low_freq_factor"], parameters["high_freq_factor"]
    smooth = (original / wavelen - low) / (high - low)
    smoothed = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, smoothed))


def quantized_tensors(path: Path, model, state: dict) -> dict[str, tuple[str, np.ndarray]]:
    """The file's matrices tessera's decoder multiplies without dequantizing, as stored: HF name ->
    (GGML type name, uint8 array [rows, row bytes]), for the 2-D tensors of a type in
    `QUANTIZED_TYPES`; the rows in transformers' order (llama's q/k permutation undone, as
    transformers undoes it on the dequantized values).

    `model`: transformers' model of the file (names and processor); `state`: its dequantized state
    dict. A tensor is kept quantized only when the gguf package's dequantization of the bytes in
    that order equals `state`'s tensor exactly; any other (a processor that changes values, stacked
    experts) stays dequantized.
    """
    import gguf
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    config = model.config.to_dict()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    names = get_gguf_hf_weights_map(model, processor)
    kept = {}
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        hf_name = names.get(tensor.name)
        if qtype not in QUANTIZED_TYPES or len(tensor.shape) != 2 or hf_name not in state:
            continue
        raw = np.asarray(tensor.data)
        order = np.arange(raw.shape[0])
        if isinstance(processor, LlamaTensorProcessor) and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = config["num_attention_heads"] if ".attn_q." in tensor.name else config["num_key_value_heads"]
            order = processor._reverse_permute_weights(order[:, None], heads, heads)[:, 0]
        raw = np.ascontiguousarray(raw[order])
        expected = state[hf_name].detach().float().numpy()
        values = gguf.quants.dequantize(raw, tensor.tensor_type)
        if values.shape == expected.shape and np.array_equal(values.astype(np.float32), expected):
            kept[hf_name] = (qtype, raw)
    return kept
