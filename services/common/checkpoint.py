"""A Hugging Face checkpoint's config.json, read once into a typed object its loaders receive, and the
one check that a directory is a decoder checkpoint tessera serves (`check_decoder_dir`).

`check_decoder_dir` needs no torch: `tessera up` runs it before any service starts, and the
decoder runs it again at its own start, so both refuse a directory with the same one line.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import InvalidArgument
from services.common.mrope import QWEN_VL_MODEL_TYPES

# model_type -> the architecture transformers names for it; services/decoder/models.py holds one model
# family per entry (Qwen2-VL's language model through model_qwen2_vl.py).
DECODER_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
# the dtype names config.json's torch_dtype / dtype may hold (transformers resolves them with
# getattr(torch, name) when it reads the config, as AutoTokenizer does)
TORCH_DTYPE_NAMES = frozenset({"auto", "float32", "float", "float16", "half", "bfloat16", "float64", "double",
                               "int8", "uint8", "int16", "int32", "int64", "bool", "float8_e4m3fn",
                               "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# rope_type -> served; each computed by transformers' own ROPE_INIT_FUNCTIONS (services/decoder/rotary.py).
# "mrope" is Qwen2-VL's legacy spelling of default RoPE with M-RoPE sections.
ROPE_TYPES = ("default", "mrope", "linear", "dynamic", "yarn", "llama3")
# rope_type -> why it is refused, where transformers has it but the decoder cannot serve it exactly
ROPE_REFUSALS = {
    "longrope": "it is served for Phi-3 (model_type 'phi3') only, whose generate recomputes every key on the long "
                "factors once a sequence outgrows original_max_position_embeddings; other families keep keys "
                "computed on either set",
}
# model_type -> the rope_types its native file serves, where they are not ROPE_TYPES (Phi3Config reads
# the legacy "yarn" as longrope, services/decoder/model_phi3.py; its legacy "su" fails in transformers 5)
FAMILY_ROPE_TYPES = {"phi3": ("default", "longrope", "yarn")}
# model_type -> the MLP activations its native file computes (config.json's `hidden_act`, or
# `hidden_activation` as Gemma writes it); a family absent here computes SiLU only
ACTIVATIONS: dict[str, tuple[str, ...]] = {
    "gemma": ("gelu_pytorch_tanh", "gelu"),  # GemmaConfig reads Gemma 1's legacy "gelu" as the tanh GELU
    "gemma2": ("gelu_pytorch_tanh",),
    "gemma3_text": ("gelu_pytorch_tanh",),
}
# how a decoder checkpoint is served (the decoder's --model-impl, as vLLM's): "native" a family of
# DECODER_ARCHITECTURES, "transformers" transformers' own modeling code on tessera's paged KV cache
# (services/decoder/model_transformers.py), "auto" native where a family exists, else transformers
MODEL_IMPLS = ("auto", "native", "transformers")
# what AutoTokenizer loads without converting: a fast tokenizer, a sentencepiece model, or BPE files
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


@dataclass(frozen=True)
class CheckpointConfig:
    """The fields of config.json tessera reads, for the language model of the checkpoint.

    A vision-language checkpoint nests its language model's config in `text_config`; the typed
    fields come from there when present (the top level otherwise). `raw` keeps the whole file for
    family-specific keys (vision_config, rope_scaling, judge templates).

    Attributes:
        model_dir: the checkpoint directory.
        raw: config.json as parsed.
        model_type, architectures: as in the file ("" and () when absent).
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        max_position_embeddings: None when absent.
        num_key_value_heads: the config's, else num_attention_heads (no grouped-query attention).
        head_dim: the config's `head_dim`, else hidden_size // num_attention_heads (the
            transformers Llama/Qwen2 convention); None when neither is known.
    """

    model_dir: Path
    raw: Mapping[str, Any]
    model_type: str
    architectures: tuple[str, ...]
    hidden_size: int | None
    intermediate_size: int | None
    num_hidden_layers: int | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    max_position_embeddings: int | None

    @classmethod
    def read(cls, model_dir: str | Path) -> CheckpointConfig:
        """Raises ValueError: no readable config.json in `model_dir` (the message names the path)."""
        model_dir = Path(model_dir).expanduser()
        path = model_dir / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"model_dir {str(model_dir)!r} has no readable config.json: {error}") from error
        if not isinstance(raw, dict):
            raise ValueError(f"config.json holds a JSON {type(raw).__name__}, not an object")
        text = raw.get("text_config") or raw
        if not isinstance(text, dict):
            raise ValueError(f"config.json's text_config is a JSON {type(text).__name__}, not an object")
        architectures = raw.get("architectures") or ()
        if not isinstance(architectures, list | tuple) or not all(isinstance(a, str) for a in architectures):
            raise ValueError(f"config.json's architectures must be a list of names, got {architectures!r}")
        model_type = raw.get("model_type", "")
        if not isinstance(model_type, str):
            raise ValueError(f"config.json's model_type must be a string, got {model_type!r}")
        hidden = _int(text, "hidden_size")
        heads = _int(text, "num_attention_heads")
        head_dim = _int(text, "head_dim") or (hidden // heads if hidden and heads else None)
        return cls(model_dir=model_dir, raw=raw, model_type=model_type, architectures=tuple(architectures),
                   hidden_size=hidden, intermediate_size=_int(text, "intermediate_size"),
                   num_hidden_layers=_int(text, "num_hidden_layers"), num_attention_heads=heads,
                   num_key_value_heads=_int(text, "num_key_value_heads") or heads, head_dim=head_dim,
                   max_position_embeddings=_int(text, "max_position_embeddings"))

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level key of config.json."""
        return self.raw.get(key, default)


def _int(config: Mapping[str, Any], name: str) -> int | None:
    """config[name] as an int, None when absent. Raises ValueError for any other JSON value
    (a float, a string, a list, true/false: transformers would fail on them later, less clearly)."""
    value = config.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.json's {name} must be an integer, got {value!r}")
    return value


def rope_settings(config: Mapping[str, Any]) -> tuple[str, float]:
    """(rope_type, rope_theta) of a text model's config as transformers 5 reads them: a legacy
    `rope_scaling` replaces `rope_parameters` when both are present (its theta, else the top-level
    `rope_theta`, else 10000); the type is `rope_type` or the legacy `type`, "default" when absent.

    Raises:
        ValueError: either field not an object, or a theta that is not a positive finite number.
    """
    for name in ("rope_scaling", "rope_parameters"):
        if config.get(name) is not None and not isinstance(config[name], dict):
            raise ValueError(f"config.json's {name} must be an object, got {config[name]!r}")
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return str(rope_type), _positive_number(rope.get("rope_theta", config.get("rope_theta", 10000.0)), "rope_theta")


def check_rope_type(rope_type: str, served: tuple[str, ...] = ROPE_TYPES) -> None:
    """Raises ValueError in one line naming `rope_type` (and why) unless it is one of `served`."""
    if rope_type not in served:
        why = ROPE_REFUSALS.get(rope_type, f"the served types are {', '.join(served)}")
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported: {why}")


def _positive_number(value: Any, name: str) -> float:
    """`value` as a float. Raises ValueError naming config.json's `name` unless it is a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"config.json's {name} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class MoeLayout:
    """Where a mixture-of-experts checkpoint's routed experts are (services/decoder/moe.py).

    Attributes:
        num_experts: routed experts per sparse layer.
        moe_intermediate_size: each expert's intermediate size.
        sparse_layers: the layers whose MLP is the sparse block (the others are dense).
    """

    num_experts: int
    moe_intermediate_size: int
    sparse_layers: tuple[int, ...]


# model_type -> (config keys of the expert count, whether Qwen's decoder_sparse_step / mlp_only_layers
# pick the sparse layers, as transformers' Qwen3MoeDecoderLayer; else every layer is sparse, as Mixtral)
MOE_FAMILIES = {"mixtral": (("num_local_experts",), False),
                "qwen2_moe": (("num_experts", "num_local_experts"), True),
                "qwen3_moe": (("num_experts", "num_local_experts"), True)}


def moe_layout(config: Mapping[str, Any], num_layers: int, intermediate_size: int) -> MoeLayout | None:
    """The routed experts of a text config.json of a MOE_FAMILIES model_type; None for other types.
    The expert size is `moe_intermediate_size`, else `intermediate_size` (Mixtral's).

    Raises:
        ValueError: no expert count under the family's keys, or a decoder_sparse_step that is not a
            positive integer (transformers divides by it).
    """
    family = MOE_FAMILIES.get(config.get("model_type"))
    if family is None:
        return None
    keys, sparse_step = family
    num_experts = next((config[key] for key in keys if config.get(key) is not None), None)
    if num_experts is None:
        raise ValueError(f"config.json has no {' or '.join(keys)}")
    layers = range(num_layers)
    if sparse_step:
        step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"config.json's decoder_sparse_step must be a positive integer, got {step!r}")
        layers = [i for i in layers if i not in dense and num_experts > 0 and (i + 1) % step == 0]
    return MoeLayout(num_experts, config.get("moe_intermediate_size") or intermediate_size, tuple(layers))


# the safetensors header key of a checkpoint holding GGUF blocks (`tessera models import --keep-quantized`):
# JSON {HF tensor name: GGML type name}; each named tensor is uint8 [rows, row bytes] (services/decoder/quant.py)
QUANTIZATION_METADATA = "tessera.gguf_types"

# What decides whether LoRA factors fit a base model's linears and address the same token ids.
_BASE_MODEL_FIELDS = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


def base_model_digest(config: CheckpointConfig) -> str:
    """sha256 hex of the canonical JSON of the base model's architecture fields: model_type,
    architectures, hidden/intermediate sizes, layers, attention and key-value heads, head_dim and
    vocab_size (the language model's, for a VLM).

    Equal for checkpoints that differ only in weights (a base model and its fine-tune share it),
    so an adapter is tied to an architecture and vocabulary, not to one set of weights.
    """
    text = config.raw.get("text_config") or config.raw
    fields = {name: getattr(config, name) for name in _BASE_MODEL_FIELDS if name != "vocab_size"}
    fields["architectures"] = list(config.architectures)
    fields["vocab_size"] = _int(text, "vocab_size")
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def base_model_name(config: CheckpointConfig) -> str:
    """A readable name of a base model for messages and listings, e.g.
    "SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, hidden 576)"."""
    architecture = config.architectures[0] if config.architectures else config.model_type or "unknown architecture"
    return (f"{config.model_dir.name} ({architecture}, {config.num_hidden_layers} layers, "
            f"hidden {config.hidden_size})")


def check_decoder_dir(model_dir: str | Path, model_impl: str = "auto") -> CheckpointConfig:
    """The checkpoint's config when `model_dir` holds a decoder tessera serves: a config.json whose
    model_type is in DECODER_ARCHITECTURES with the sizes a model needs, or (`decoder_impl`) a causal
    LM transformers builds, safetensors weights (WEIGHT_FILES) and tokenizer files (TOKENIZER_FILES).
    Reads config.json only, never the weights.

    Raises:
        InvalidArgument: one line naming the directory and what is wrong: the path is missing or
            not a directory, config.json is missing or unreadable, the architecture found and the
            supported ones (an encoder or seq2seq model), a missing size, or the missing weight or
            tokenizer files.
    """
    path = Path(model_dir).expanduser()
    where = f"decoder model dir {str(path)!r}"
    if not path.is_dir():
        raise InvalidArgument(f"{where} {'is not a directory' if path.exists() else 'does not exist'}")
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"{where} has no config.json (not a Hugging Face checkpoint)")
    try:
        config = CheckpointConfig.read(path)
    except ValueError as error:
        raise InvalidArgument(f"{where}: {error}") from None
    try:
        impl = decoder_impl(config, model_impl)
    except ValueError as error:
        raise InvalidArgument(f"{where} {error}") from None
    if impl == "native":
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(config, name) is None:
                raise InvalidArgument(f"{where}: config.json has no {name}")
    try:
        if impl == "native":
            _check_language_model(config)
        else:  # transformers' own config class reads and checks the rest when the decoder loads it
            _check_dtype_names(config)
    except ValueError as error:
        raise InvalidArgument(f"{where}: {error}") from None
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.gguf"))
        found = f" (found {', '.join(other[:3])}: convert to safetensors, or `tessera models import` a GGUF)" \
            if other else ""
        raise InvalidArgument(f"{where} has no weights: neither {' nor '.join(WEIGHT_FILES)}{found}")
    if not any(all((path / name).is_file() for name in names) for names in TOKENIZER_FILES):
        wanted = ", ".join(" + ".join(names) for names in TOKENIZER_FILES)
        raise InvalidArgument(f"{where} has no tokenizer: one of {wanted} is needed")
    return config


def _check_language_model(config: CheckpointConfig) -> None:
    """What every supported decoder family needs of config.json, checked before any weight is read:
    positive sizes, heads that split the hidden size and share key-value heads evenly, a vocabulary,
    SiLU, a served RoPE type (`ROPE_TYPES`; plain RoPE for Qwen2-VL) with a positive theta, a positive
    RMSNorm epsilon. Raises ValueError naming the field, its value and what is needed."""
    text = config.raw.get("text_config") or config.raw
    sizes = {name: getattr(config, name) for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                       "num_attention_heads", "num_key_value_heads", "head_dim",
                                                       "max_position_embeddings")}
    sizes["vocab_size"] = _int(text, "vocab_size")
    for name in ("vocab_size", "intermediate_size"):
        if sizes[name] is None:
            raise ValueError(f"config.json has no {name}")
    for name, value in sizes.items():
        if value is not None and value < 1:
            raise ValueError(f"config.json's {name} is {value}; it must be at least 1")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads:
        raise ValueError(f"config.json's num_attention_heads {heads} is not a multiple of num_key_value_heads "
                         f"{kv_heads} (each key-value head serves the same number of query heads)")
    if _int(text, "head_dim") is None and config.hidden_size % heads:
        raise ValueError(f"config.json's hidden_size {config.hidden_size} does not split into "
                         f"num_attention_heads {heads} heads, and there is no head_dim")
    if config.head_dim % 2:
        raise ValueError(f"head_dim {config.head_dim} is odd; rotary embeddings rotate pairs")
    activation = text.get("hidden_act") or text.get("hidden_activation") or "silu"
    served = ACTIVATIONS.get(config.model_type, ("silu",))
    if activation not in served:
        raise ValueError(f"config.json's hidden_act is {activation!r}; {config.model_type or 'this family'} is served "
                         f"with {' or '.join(map(repr, served))}")
    # Qwen2-VL's M-RoPE takes plain frequencies only (services/decoder/model_qwen2_vl.py)
    check_rope_type(rope_settings(text)[0], ("default", "mrope") if config.model_type in QWEN_VL_MODEL_TYPES
                    else FAMILY_ROPE_TYPES.get(config.model_type, ROPE_TYPES))
    _check_dtype_names(config)
    _positive_number(text.get("rms_norm_eps", 1e-6), "rms_norm_eps")


def _check_dtype_names(config: CheckpointConfig) -> None:
    """Raises ValueError naming the key unless config.json's torch_dtype / dtype (top level and
    text_config) are torch dtype names."""
    for scope in (config.raw, config.raw.get("text_config") or config.raw):
        for key in ("torch_dtype", "dtype"):
            declared = scope.get(key)
            if declared is not None and (not isinstance(declared, str)
                                         or declared.removeprefix("torch.") not in TORCH_DTYPE_NAMES):
                raise ValueError(f"config.json's {key} is {declared!r}, not a torch dtype name "
                                 f"(e.g. float32, bfloat16, float16)")


def decoder_impl(config: CheckpointConfig, model_impl: str = "auto") -> str:
    """How the decoder serves `config`: "native" (a family of DECODER_ARCHITECTURES) or
    "transformers" (transformers' own causal LM class on tessera's paged KV cache), for the
    decoder's `model_impl` (MODEL_IMPLS; "auto": native where a family exists, as vLLM's
    --model-impl). Imports transformers (and torch) only for a model_type with no native family.

    Raises:
        ValueError: one line, starting "holds architecture ...", naming what the checkpoint is and
            why neither path serves it: an unknown `model_impl`, no native family for "native", or
            (`transformers_refusal`) not a causal LM transformers builds (an encoder, a seq2seq model).
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"holds {_described(config)}; model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
    native = config.model_type in DECODER_ARCHITECTURES
    if model_impl == "native" or (model_impl == "auto" and native):
        if not native:
            raise ValueError(f"holds {_described(config)}, which has no native family (model_impl 'native'); "
                             f"native: {_native_names()}")
        return "native"
    if config.get("vision_config") is not None:
        raise ValueError(f"holds {_described(config)}: model_impl 'transformers' serves text-only causal LMs")
    why = transformers_refusal(config)
    if why is not None:
        raise ValueError(why)
    return "transformers"


def transformers_refusal(config: CheckpointConfig) -> str | None:
    """Why transformers' path cannot serve `config` (one line, starting "holds architecture ..."), or
    None: it names one architecture, the causal LM class transformers' MODEL_FOR_CAUSAL_LM_MAPPING
    builds for its model_type, and it is not an encoder-decoder."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return f"holds {_described(config)}, not a supported decoder; supported: {_native_names()} (transformers, " \
               "which serves the others, is not installed)"
    causal_lms = {name for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
                  for name in ((value,) if isinstance(value, str) else value)}
    architecture = config.architectures[0] if config.architectures else None
    if architecture not in causal_lms or config.get("is_encoder_decoder"):
        return (f"holds {_described(config)}, not a supported decoder; supported: {_native_names()}, or a causal LM "
                "transformers builds (its MODEL_FOR_CAUSAL_LM_MAPPING; encoders and seq2seq models are not)")
    expected = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if architecture not in ((expected,) if isinstance(expected, str) else expected or ()):
        return (f"holds {_described(config)}: model_type {config.model_type or 'missing'!r} is not supported with it; "
                f"transformers builds {expected or 'no causal LM'} for that model_type")
    return None


def _described(config: CheckpointConfig) -> str:
    """e.g. "architecture BertModel (model_type 'bert')"."""
    found = ", ".join(config.architectures) or "none named"
    return f"architecture {found} (model_type {config.model_type or 'missing'!r})"


def _native_names() -> str:
    return ", ".join(f"{arch} ({kind})" for kind, arch in DECODER_ARCHITECTURES.items())
