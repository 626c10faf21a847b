"""Any causal LM transformers builds, through its own modeling code, on tessera's paged KV cache.

The way vLLM's Transformers backend serves architectures it has no native file for: the model is
transformers' `AutoModelForCausalLM` class, loaded from the checkpoint as transformers loads it,
with `attn_implementation="tessera_paged"`: a function registered in transformers'
`AttentionInterface` that every attention layer calls with its (already rotated) q, k, v. It writes
the layer's K/V into tessera's paged cache at the step's slot mapping and attends with the model
runner's attention backend over the block tables, so the scheduler's continuous batching, chunked
prefill, prefix cache and preemption work unchanged. A step's flat batch runs as one sequence
[1, num_tokens] with `position_ids` = each row's own position; no transformers cache (`use_cache`
False) and no transformers mask (the function is absent from `AttentionMaskInterface`, so
transformers builds none; the backend's block tables make attention causal per request).

Logits come from the model's own head code: `compute_logits` runs transformers' ForCausalLM
forward with its base model standing in for the rows given, so a head's scaling or soft-capping
(Cohere's logit_scale, Gemma 2's final_logit_softcapping, Granite's logits_scaling) is exactly
transformers'. LoRA: every nn.Linear of the base model becomes a `LoRALinear` holding the same
weights, named as transformers (and PEFT) name it ("gpt_neox.layers.0.attention.query_key_value").

A layer's `sliding_window` and `softcap` (Mistral, Starcoder2, Gemma 2) reach the backend as its
`sliding_window` / `logits_soft_cap` options. Refused in one line: a class that does not route
attention through the interface (`_supports_attention_backend` False), weights that do not match
the class (a tensor missing, unexpected or of another shape, by transformers' own loading info:
transformers itself would serve a missing one randomly initialised), layers whose keys differ in
shape (one paged cache holds every layer), M-RoPE sections.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.pytorch_utils import Conv1D

from services.common.checkpoint import CheckpointConfig
from services.decoder.attention import AttentionBackend, AttentionMetadata
from services.decoder.kv_cache import KVCache
from services.decoder.lora import LoRALinear

ATTENTION_NAME = "tessera_paged"  # transformers' attn_implementation for tessera's paged attention


@dataclass(frozen=True)
class TransformersSpec:
    """The architecture facts the engine reads, from transformers' config object (its attribute
    names: `num_hidden_layers` whatever config.json calls it)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    sliding_window: int | None = None  # the window every layer attends within; None: a layer attends fully

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> TransformersSpec:
        """The spec of a loaded model; key heads and head size as its attention layers compute them
        (`_probe_kv_shapes`: a config's num_key_value_heads is not read by every family).

        Raises:
            ValueError: layers whose keys differ in shape, or layer indices that are not 0..layers-1.
        """
        config = model.config.get_text_config()
        probe = _probe(model)
        shapes, windows = probe.shapes, set(probe.windows.values())
        if sorted(shapes) != list(range(len(shapes))) or len(set(shapes.values())) != 1:
            raise ValueError(f"{type(model).__name__}'s attention layers compute keys of (heads, head size) "
                             f"{dict(sorted(shapes.items()))} by layer index; the paged KV cache needs one shape "
                             "for layers 0..n-1")
        num_kv_heads, head_dim = shapes[0]
        return cls(architecture=type(model).__name__, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   num_layers=len(shapes), num_heads=config.num_attention_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, max_position_embeddings=getattr(config, "max_position_embeddings", None),
                   sliding_window=None if None in windows else max(windows))


@dataclass(frozen=True)
class _Step:
    """What the attention function needs during one forward: the cache, the backend, its metadata."""

    cache: KVCache
    attention: AttentionBackend
    meta: AttentionMetadata


@dataclass(frozen=True)
class _Probe:
    """A forward that records each layer's key shape (kv heads, head size) and sliding window (None:
    full attention) instead of attending."""

    shapes: dict[int, tuple[int, int]]
    windows: dict[int, int | None]


_STEP: contextvars.ContextVar[_Step | _Probe | None] = contextvars.ContextVar("tessera_paged_step", default=None)


def _probe_kv_shapes(model: PreTrainedModel) -> dict[int, tuple[int, int]]:
    """{layer_idx: (kv heads, head size)} of every attention call of one two-token forward."""
    return _probe(model).shapes


def _probe(model: PreTrainedModel) -> _Probe:
    """Each attention call's key shape and sliding window in one two-token forward of `model`."""
    probe = _Probe({}, {})
    token = _STEP.set(probe)
    try:
        with torch.inference_mode():
            model.base_model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=model.device),
                             position_ids=torch.arange(2, device=model.device)[None], use_cache=False)
    finally:
        _STEP.reset(token)
    return probe


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract over tessera's paged cache (registered as
    ATTENTION_NAME): writes layer `module.layer_idx`'s K/V at the step's slot mapping, then attends
    with the step's backend. `attention_mask` is None (no mask is built for this implementation) and
    `dropout` is 0 in eval; `sliding_window` / `softcap` kwargs (or the module's `sliding_window`)
    become the backend's `sliding_window` / `logits_soft_cap`.

    Args:
        query: [1, heads, num_tokens, head_dim]; key, value: [1, kv_heads, num_tokens, head_dim],
            rotated as the model rotates them.
    Returns:
        ([1, num_tokens, heads, head_dim] in query's dtype, None): the layout transformers'
        attention functions return, and no attention weights.
    Raises:
        RuntimeError: called outside `TransformersForCausalLM.forward`.
        ValueError: key heads or head size other than the cache's.
    """
    step = _STEP.get()
    if step is None:
        raise RuntimeError(f"attn_implementation {ATTENTION_NAME!r} runs inside TransformersForCausalLM.forward only")
    layer = module.layer_idx
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if isinstance(step, _Probe):
        step.shapes[layer], step.windows[layer] = (key.shape[1], key.shape[-1]), window
        return torch.zeros_like(query).transpose(1, 2), None
    k_cache, v_cache = step.cache.layer(layer)  # [kv_heads, slots, head_dim]
    if key.shape[1] != k_cache.shape[0] or key.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"layer {layer} computes {key.shape[1]} key heads of size {key.shape[-1]}; the KV cache "
                         f"holds {k_cache.shape[0]} of size {k_cache.shape[-1]} (config.json's sizes)")
    options = {"sliding_window": window, "logits_soft_cap": kwargs.get("softcap")}
    options = {name: value for name, value in options.items() if value is not None}
    q = query[0].transpose(0, 1).contiguous()  # [num_tokens, heads, head_dim]
    k = key[0].transpose(0, 1).contiguous()    # [num_tokens, kv_heads, head_dim]
    v = value[0].transpose(0, 1).contiguous()
    step.attention.write_kv(step.cache, layer, k, v, step.meta)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = step.attention.forward(q, k_cache, v_cache, step.meta, scale, **options)  # [num_tokens, heads, head_dim]
    return out[None], None


def register_paged_attention() -> None:
    """Register `paged_attention` as transformers' attn_implementation ATTENTION_NAME (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)


class TransformersLoRALinear(LoRALinear):
    """A transformers nn.Linear as tessera's LoRALinear: inputs of any leading shape ([1, n, in] in
    transformers' modules) are flattened to the [rows, in] the GEMM and the LoRA context take."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [num_tokens, in]
        return super().forward(rows).view(*x.shape[:-1], -1)


def wrap_linears(model: PreTrainedModel) -> int:
    """Replace every nn.Linear of `model`'s base model (not the head) with a TransformersLoRALinear
    holding the same parameters, and every transformers Conv1D (GPT-2's x @ W + b, W [in, out]) with
    one holding its weight transposed; each one's LoRA target name is the module's own name in
    `model` (PEFT's names past "base_model.model."). Returns how many were replaced."""
    prefix = model.base_model_prefix
    replaced = 0
    for parent_name, parent in list(model.base_model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                weight, bias = child.weight, child.bias  # [out, in]
            elif type(child) is Conv1D:
                weight = nn.Parameter(child.weight.detach().t().contiguous(), requires_grad=False)  # [out, in]
                bias = child.bias
            else:
                continue
            out_features, in_features = weight.shape
            with torch.device("meta"):
                layer = TransformersLoRALinear(in_features, out_features, bias=bias is not None)
            layer.weight, layer.bias = weight, bias
            name = ".".join(part for part in (prefix, parent_name, child_name) if part)
            layer.lora_slices = ((name, 0, out_features),)
            setattr(parent, child_name, layer)
            replaced += 1
    return replaced


def kv_shape(model_dir: str | Path) -> tuple[int, int, int]:
    """(layers, kv heads, head size) of the KV cache, before any weight is read: probed on the model
    built on the meta device (`_probe_kv_shapes`), as `TransformersSpec.from_model` probes the
    loaded one; where a family's forward cannot run on meta tensors (GPT-2 reads a value), from
    transformers' config class: num_key_value_heads, else num_attention_heads; head_dim, else
    hidden_size // heads."""
    config = AutoConfig.from_pretrained(model_dir)
    register_paged_attention()
    try:
        with torch.device("meta"):
            shapes = _probe_kv_shapes(AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME))
        if shapes and len(set(shapes.values())) == 1:
            return (len(shapes), *shapes[0])
    except (RuntimeError, NotImplementedError):  # torch's answers to data reads of meta tensors
        pass
    text = config.get_text_config()
    heads = text.num_attention_heads
    return (text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads,
            getattr(text, "head_dim", None) or text.hidden_size // heads)


def max_positions(model_dir: str | Path) -> int | None:
    """The model's max_position_embeddings as transformers' config class reads it (GPT-2's
    n_positions through its attribute map), or None when it declares none."""
    value = getattr(AutoConfig.from_pretrained(model_dir).get_text_config(), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


@dataclass
class _Rows(BaseModelOutputWithPastAndCrossAttentions):
    """A base model's output holding only its last hidden state; any other field a ForCausalLM
    reads (a MoE model's `router_logits`, which it hands to its output) is None."""

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _Precomputed(nn.Module):
    """Stands in for a base model during `compute_logits`: returns the rows it was given."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs) -> BaseModelOutputWithPastAndCrossAttentions:
        return _Rows(last_hidden_state=self.hidden)


class _NoRotaryTable:
    """The engine moves a native model's cos/sin table to the device; transformers' model computes
    its own rotary inside its forward, so there is nothing to move."""

    def to(self, device: torch.device) -> _NoRotaryTable:
        return self


class TransformersForCausalLM(nn.Module):
    """forward: flat batch -> the base model's last hidden state (final norm applied, as
    transformers' base models return it); compute_logits: selected rows -> the model's own head."""

    def __init__(self, model: PreTrainedModel, spec: TransformersSpec) -> None:
        super().__init__()
        self.hf = model
        self.spec = spec
        self.rotary = _NoRotaryTable()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [num_tokens, hidden] for int64 ids [num_tokens] (the input embedding module's)."""
        return self.hf.get_input_embeddings()(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                attention: AttentionBackend, meta: AttentionMetadata, embed_rows: torch.Tensor | None = None,
                embed_values: torch.Tensor | None = None) -> torch.Tensor:
        """Run transformers' base model over a flat batch as one sequence [1, num_tokens].

        Args:
            input_ids: int64 [num_tokens].
            positions: int64 [num_tokens], each row's position in its request (`position_ids`).
            cache, attention, meta: as LlamaForCausalLM.forward: the K/V of this step are written at
                `meta.slot_mapping` by `paged_attention`.
            embed_rows / embed_values: optional int64 [n] rows whose embeddings are replaced by
                `embed_values` [n, hidden] (then transformers gets `inputs_embeds`).
        Returns:
            the base model's last hidden state [num_tokens, hidden].
        Raises:
            ValueError: positions not [num_tokens] (M-RoPE needs a native family).
        """
        if positions.dim() != 1:
            raise ValueError(f"positions {tuple(positions.shape)}: transformers' path takes one position per token")
        inputs = {"input_ids": input_ids[None]}  # [1, num_tokens]
        if embed_rows is not None and embed_rows.numel():
            embeddings = self.embed(input_ids)  # [num_tokens, hidden]
            embeddings[embed_rows] = embed_values.to(embeddings.dtype)
            inputs = {"inputs_embeds": embeddings[None]}
        token = _STEP.set(_Step(cache, attention, meta))
        try:
            out = self.hf.base_model(**inputs, position_ids=positions[None], use_cache=False)
        finally:
            _STEP.reset(token)
        return out.last_hidden_state[0]  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows [rows, hidden] of `forward`'s output -> float32 logits [rows, vocab], computed by
        transformers' ForCausalLM forward itself (its head, then any scaling or soft cap it applies)
        with the base model replaced, for this call, by the rows."""
        prefix = self.hf.base_model_prefix
        base = self.hf._modules[prefix]
        self.hf._modules[prefix] = _Precomputed(hidden[None])  # [1, rows, hidden]
        try:
            logits = self.hf(inputs_embeds=hidden[None], use_cache=False).logits  # [1, rows, vocab]
        finally:
            self.hf._modules[prefix] = base
        return logits[0].float()


def check_loading_info(model: PreTrainedModel, info: dict, model_dir: str | Path) -> None:
    """Refuse weights that do not match `model`, from transformers' own loading info
    (`from_pretrained(..., output_loading_info=True)`: missing_keys, unexpected_keys,
    mismatched_keys (name, checkpoint shape, model shape), error_msgs), which already leaves out
    what transformers fills in by design: a head tied to the embeddings (tie_word_embeddings),
    non-persistent buffers, the class's `_keys_to_ignore_on_load_missing/unexpected`. transformers
    itself only logs these (a missing tensor is served randomly initialised), as the native path
    does not.

    Raises:
        ValueError: one line, "weights in <dir> do not match <class>: ...", naming the first missing
            tensors (in the model's order), the unexpected ones and the first of another shape.
    """
    missing, unexpected = set(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    mismatched, errors = list(info.get("mismatched_keys") or ()), list(info.get("error_msgs") or ())
    if not (missing or unexpected or mismatched or errors):
        return
    order = {name: index for index, name in enumerate(model.state_dict())}
    missing = sorted(missing, key=lambda name: (order.get(name, len(order)), name))
    mismatched.sort(key=lambda entry: (order.get(entry[0], len(order)), entry[0]))
    parts = []
    if missing:
        parts.append(f"missing {missing[:5]}{f' and {len(missing) - 5} more' if len(missing) > 5 else ''} "
                     "(transformers would serve them randomly initialised)")
    if unexpected:
        parts.append(f"unexpected {unexpected[:5]}{f' and {len(unexpected) - 5} more' if len(unexpected) > 5 else ''}")
    if mismatched:
        name, found, wanted = mismatched[0]
        more = f" ({len(mismatched) - 1} more of another shape)" if len(mismatched) > 1 else ""
        parts.append(f"{name} has shape {list(found)} where config.json's sizes need {list(wanted)}{more}")
    if errors:
        parts.append(" ".join(str(errors[0]).split()))
    raise ValueError(f"weights in {model_dir} do not match {type(model).__name__}: {'; '.join(parts)}")


def load_transformers_model(checkpoint: CheckpointConfig, dtype: torch.dtype) -> TransformersForCausalLM:
    """transformers' causal LM class for `checkpoint`, its weights loaded by transformers in `dtype`,
    attention through `paged_attention`, its base model's linears LoRA-capable (`wrap_linears`).

    Raises:
        ValueError: one line: the class does not use transformers' attention interface, the weights do
            not match the class (`check_loading_info`: a tensor missing, unexpected or of another
            shape), or its layers' keys differ in shape (`TransformersSpec.from_model`); whatever
            transformers raises for a config or weights it cannot read.
    """
    config = AutoConfig.from_pretrained(checkpoint.model_dir)
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if not model_cls._supports_attention_backend:
        raise ValueError(f"{model_cls.__name__} does not call transformers' attention interface "
                         "(_supports_attention_backend is False), so tessera's paged attention cannot run it")
    register_paged_attention()
    # sizes that differ are reported in `info` (then refused) instead of transformers' RuntimeError
    model, info = AutoModelForCausalLM.from_pretrained(checkpoint.model_dir, dtype=dtype,
                                                       attn_implementation=ATTENTION_NAME, output_loading_info=True,
                                                       ignore_mismatched_sizes=True)
    check_loading_info(model, info, checkpoint.model_dir)
    wrap_linears(model)
    return TransformersForCausalLM(model.eval(), TransformersSpec.from_model(model))
