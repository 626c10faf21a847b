"""Reading a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors).

Everything is validated before anything is accepted: unsupported PEFT features are refused with
a message naming the config field, so an adapter is never served with silently different math.
Scales follow PEFT's `LoraLayer.update_layer` (alpha/r, or alpha/sqrt(r) with use_rslora), and
per-module rank/alpha follow `rank_pattern`/`alpha_pattern` matched as PEFT's `get_pattern_key`.

Config and weights must agree: every weight pair belongs to a module that `target_modules` names
(targets.py), and with a base model every target entry matches one of its linears and every pair
fits its layer and the configured rank. The first mismatch is refused, named.

MoE experts (PEFT's `target_parameters`, e.g. ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
on transformers 5's 3-D expert weights [experts, out, in]): PEFT's ParamWrapper stores one pair per
weight, lora_A [r * E, in] (expert e's A is rows e*r .. e*r + r) and lora_B [out, r * E] (expert
e's B is columns e, E + e, 2E + e, ...), and nests two wrappers on one module, so the first
weight in the module's declaration order (gate_up_proj) is saved as `experts.base_layer.lora_A`
and the second as `experts.lora_A`. Expert e's delta is scale * B_e A_e, so each is read as its
own target "<layer>.mlp.experts.<e>.<part>" (services/common/lora_names.py), its rank and alpha
those rank_pattern / alpha_pattern give the weight's name "<layer>.mlp.experts.<part>".

Effective-delta bound. Per target, with A [r, in] and scaled B' [out, r] (scale folded in):

    bound = max_i sum_k |B'[i, k]| * max_j |A[k, j]|      (float64; >= max |B' A|, equal for r = 1)

must be finite and at most DELTA_SCALE_FACTOR (1e3) x the base layer's max |W| (when the registry
has the base weights; else x 1.0, the order of a trained LLM linear's largest weight). Trained
adapters sit orders of magnitude below: their deltas are small next to the weights they adjust.
A delta past it swamps the layer, and its products with activations leave float16's range
(65504) and soon float32's, so the decoder would serve garbage or non-finite logits. Each factor
value is also bounded (FACTOR_LIMIT, 1e20): a huge A beside a tiny B keeps the product small but
overflows the shrink x A^T the decoder computes first.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from services.adapters.base_model import BaseModelShapes
from services.adapters.paths import AdapterDir, open_in_root
from services.adapters.targets import MAX_CONFIG_ENTRIES, TargetModules, match_module
from services.adapters.types import LoRAAdapter, LoRATarget
from services.common.errors import InvalidArgument
from services.common.lora_names import EXPERT_PARTS, ROUTER_WEIGHT, expert_target
from tessera.protocol import MAX_MESSAGE_BYTES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
_WRAPPED_EXPERTS = re.compile(r"^(?P<module>.+\.experts)(?P<wrappers>(?:\.base_layer)*)$")
_EMBEDDING_NAMES = {"embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out"}
_FLOAT_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
DELTA_SCALE_FACTOR = 1e3
FACTOR_LIMIT = 1e20  # |x|_1 of a hidden state (1e4 x 16k) times 1e20 stays 1e10 below float32's 3.4e38


@dataclass(frozen=True)
class LoRASettings:
    """The accepted subset of a PEFT LoraConfig."""

    r: int
    lora_alpha: float
    use_rslora: bool
    targets: TargetModules
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_parameters: tuple[str, ...] = ()  # PEFT's: 3-D expert weights, "mlp.experts.gate_up_proj"

    def targets_parameter(self, name: str) -> bool:
        """Whether target_parameters names the weight `name` (PEFT: equal, or ending in "." + entry)."""
        return any(name == entry or name.endswith("." + entry) for entry in self.target_parameters)

    def rank_for(self, module: str) -> int:
        return int(self.rank_pattern.get(_pattern_key(self.rank_pattern, module, "rank_pattern"), self.r))

    def alpha_for(self, module: str) -> float:
        return float(self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module, "alpha_pattern"),
                                            self.lora_alpha))

    def scale(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_key(patterns: dict, module: str, field_name: str) -> str:
    """The first pattern that matches the end of `module` at a dot boundary (PEFT's get_pattern_key).
    Raises InvalidArgument for a pattern that takes too long (`targets.match_module`)."""
    for key in patterns:
        if match_module(_pattern_regex(key), module, field_name, whole=False):
            return key
    return module


def _pattern_regex(key: str) -> str:
    return rf"(.*\.)?({key})$"


def read_peft_adapter(directory: Path | str, root: Path, name: str, max_rank: int,
                      base: BaseModelShapes | None = None) -> LoRAAdapter:
    """`read_peft_dir` of `directory` (a path inside `root`, relative or absolute) opened with
    `paths.open_in_root`; raises what both raise."""
    with open_in_root(root, str(directory)) as opened:
        return read_peft_dir(opened, name, max_rank, base)


def read_peft_dir(directory: AdapterDir, name: str, max_rank: int,
                  base: BaseModelShapes | None = None) -> LoRAAdapter:
    """Parse and validate the PEFT LoRA adapter in `directory`, its files read only through the
    directory's descriptor (paths.py: nothing outside the adapter root is ever read).

    Returns:
        A `LoRAAdapter` whose targets hold A [r, in] and scaled B [out, r], float32.

    Raises:
        InvalidArgument: a missing/unreadable file, an unsupported PEFT feature (the message names
            the field), rank > max_rank, non-finite weights, unpaired or extra tensors, a pair for a
            module target_modules does not name, inconsistent shapes, an effective delta past the
            bound (module docstring), or (with `base`) a target entry matching no base-model
            linear, or a pair that is not a base-model linear or does not fit it.
    """
    settings = read_lora_settings(directory.read_file(CONFIG_FILE))
    if base is not None:
        settings.targets.check_against([*base.modules, *_legacy_expert_names(base)])
        _check_parameters_against(settings, base)
    tensors = _load_tensors(directory.read_file(WEIGHTS_FILE))
    pairs = _pair_tensors(tensors)
    weights = _expert_weight_pairs(pairs, settings)
    legacy = {module: pairs.pop(module) for module in sorted(pairs) if _LEGACY_EXPERT.match(module)}
    for module in [*sorted(pairs), *legacy]:
        if not (settings.targets.matches(module) or _is_router(module, settings)):
            raise InvalidArgument(f"{module[:200]}: the weights adapt a module that adapter_config.json's target_modules "
                                  "does not name")
    if (weights or legacy) and base is None:
        raise InvalidArgument(f"{sorted([*weights, *legacy])[0][:200]}: LoRA on MoE experts is read against the "
                              "registry's base model (its expert count and shapes), and this registry has none "
                              "(--base-model-dir)")
    targets: dict[str, LoRATarget] = {}
    sources: dict[str, str] = {}  # target -> the key its factors came from (two keys, one target: refused)

    def add(found: dict[str, LoRATarget], source) -> None:
        for target, value in found.items():
            first = sources.setdefault(target, source(target))
            if first != source(target):
                raise InvalidArgument(f"{target[:200]}: adapted twice, by {first[:200]} and {source(target)[:200]}; "
                                      "each weight takes one pair of LoRA factors")
            targets[target] = value

    for module, (a, b) in sorted(pairs.items()):  # the first refusal named does not depend on file order
        add({module: _build_target(module, a, b, settings, max_rank, base)}, lambda _, m=module: m)
    for weight, (a, b) in sorted(weights.items()):
        add(_expert_targets(weight, a, b, settings, max_rank, base), lambda _, w=weight: w)
    legacy_targets, legacy_sources = _legacy_expert_targets(legacy, pairs, settings, max_rank, base)
    add(legacy_targets, legacy_sources.__getitem__)
    if not targets:
        raise InvalidArgument(f"{WEIGHTS_FILE} holds no LoRA factors for any target")
    wire = sum(4 * (t.lora_a.numel() + t.lora_b.numel()) + 256 for t in targets.values())  # float32 + names
    if wire > MAX_MESSAGE_BYTES:
        raise InvalidArgument(f"the adapter's factors take {wire / 2**20:.0f} MiB as float32 on the wire to a "
                              f"decoder; the limit is {MAX_MESSAGE_BYTES / 2**20:.0f} MiB (a lower rank, or fewer "
                              "targets)")
    return LoRAAdapter(name=name, rank=max(t.rank for t in targets.values()), alpha=settings.lora_alpha,
                       use_rslora=settings.use_rslora, targets=targets)


def read_lora_settings(config: bytes) -> LoRASettings:
    """Parse the bytes of adapter_config.json, refusing every PEFT feature the decoder cannot reproduce."""
    try:
        config = json.loads(config)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidArgument(f"{CONFIG_FILE} is not readable JSON: {error}") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{CONFIG_FILE} must hold a JSON object")
    _refuse_unsupported(config)
    parameters = _target_parameters(config)
    targets = TargetModules.from_config(config, required=not parameters)
    _refuse_embedding_targets(targets)
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not _is_positive_int(r):
        raise InvalidArgument(f"adapter_config.json: r={_clip(r)} must be a positive integer")
    if not _is_finite_number(alpha):
        raise InvalidArgument(f"adapter_config.json: lora_alpha={_clip(alpha)} must be a finite number")
    rank_pattern = _pattern(config, "rank_pattern", _is_positive_int, "a positive integer rank")
    alpha_pattern = _pattern(config, "alpha_pattern", _is_finite_number, "a finite number")
    return LoRASettings(r=r, lora_alpha=float(alpha), use_rslora=bool(config.get("use_rslora")), targets=targets,
                        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, target_parameters=parameters)


def _target_parameters(config: dict) -> tuple[str, ...]:
    """target_parameters: a list of weight names, each a routed expert weight (`EXPERT_PARTS`).

    Raises:
        InvalidArgument: not a list of strings, or an entry naming another weight.
    """
    value = config.get("target_parameters")
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or not all(isinstance(entry, str) and entry for entry in value):
        raise InvalidArgument(f"adapter_config.json: target_parameters={_clip(value)} must be a list of weight names")
    if len(value) > MAX_CONFIG_ENTRIES:
        raise InvalidArgument(f"adapter_config.json: target_parameters has {len(value)} entries; the limit is "
                              f"{MAX_CONFIG_ENTRIES}")
    for entry in value:
        part = entry.rsplit(".", 1)[-1]
        expert = part in EXPERT_PARTS and (entry == part or ("." + entry).endswith(".experts." + part))
        if not (expert or ("." + entry).endswith("." + ROUTER_WEIGHT)):
            raise InvalidArgument(f"adapter_config.json: target_parameters entry {_clip(entry)} is not supported; "
                                  "LoRA on weights is served for a MoE model's routed experts "
                                  "('mlp.experts.gate_up_proj', 'mlp.experts.down_proj') and router ('mlp.gate.weight')")
    return tuple(value)


def _check_parameters_against(settings: LoRASettings, base: BaseModelShapes) -> None:
    """Refuse a target_parameters entry that names no expert weight of the base model (as PEFT refuses it)."""
    weights = {target[0] for target in map(expert_target, base.modules) if target is not None}
    weights |= {f"{module}.weight" for module in base.modules if module.endswith(".mlp.gate")}
    for entry in settings.target_parameters:
        if not any(weight == entry or weight.endswith("." + entry) for weight in weights):
            raise InvalidArgument(f"adapter_config.json: target_parameters entry {_clip(entry)} matches no expert "
                                  "weight of the base model")


# transformers 4's per-expert linears (Mixtral's w1/w3/w2 under block_sparse_moe, Qwen-MoE's
# gate_proj/up_proj/down_proj), which adapters trained before transformers 5 target
_LEGACY_EXPERT = re.compile(r"^(?P<layer>model\.layers\.\d+)\.(?:block_sparse_moe\.(?P<router>gate)|(?:block_sparse_moe|mlp)"
                            r"\.experts\.(?P<expert>\d+)\.(?P<proj>w1|w3|w2|gate_proj|up_proj|down_proj))$")
_LEGACY_GATE_UP = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}  # row block of gate_up_proj
_LEGACY_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# model_type -> PEFT converts its transformers 4 expert adapters for transformers 5 (peft's
# transformers_weight_conversion: Mixtral and Qwen3-MoE; Qwen2-MoE's are not converted)
_LEGACY_CONVERTED = ("mixtral", "qwen3_moe")
_DENSE_MLP = re.compile(r"^model\.layers\.\d+\.mlp\.(?:gate|up|down)_proj$")


def _legacy_expert_names(base: BaseModelShapes) -> list[str]:
    """transformers 4's names of the base model's per-expert linears (for target_modules like ["w1", "w2", "w3"])."""
    names = set()
    for module in base.modules:
        expert = expert_target(module)
        if expert is not None:
            layer, e = expert[0].split(".mlp.experts.")[0], expert[1]
            names.update(f"{layer}.block_sparse_moe.experts.{e}.{w}" for w in ("w1", "w3", "w2"))
            names.update(f"{layer}.mlp.experts.{e}.{w}" for w in ("gate_proj", "up_proj"))
            names.add(f"{layer}.block_sparse_moe.gate")
    return sorted(names)


def _check_legacy(legacy: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], settings: LoRASettings,
                  base: BaseModelShapes) -> None:
    """Refuse transformers 4 per-expert pairs PEFT's conversion would not compute as they were
    trained (`_legacy_expert_targets`)."""
    first = next(iter(legacy))
    if base.model_type not in _LEGACY_CONVERTED:
        raise InvalidArgument(f"{first[:200]}: transformers 4 per-expert LoRA on a {base.model_type!r} base is not "
                              f"served; PEFT converts it for {', '.join(_LEGACY_CONVERTED)} only")
    if settings.use_rslora:
        raise InvalidArgument(f"{first[:200]}: transformers 4 per-expert LoRA with use_rslora is not served (PEFT's "
                              "conversion scales the fused gate/up pair by alpha / sqrt(2 r))")
    dense = sorted(m for m in pairs if _DENSE_MLP.match(m))
    if dense:
        raise InvalidArgument(f"{dense[0][:200]} beside transformers 4 per-expert LoRA: PEFT reads dense MLP factors "
                              "as expert factors; not served")
    layers: dict[str, dict[int, set[str]]] = {}
    for module in legacy:
        if settings.rank_for(module) != settings.r or settings.alpha_for(module) != settings.lora_alpha:
            raise InvalidArgument(f"{module[:200]}: rank_pattern / alpha_pattern on a transformers 4 per-expert module "
                                  "is not served (PEFT's conversion ignores them)")
        match = _LEGACY_EXPERT.match(module)
        if not match["router"]:
            layers.setdefault(match["layer"], {}).setdefault(int(match["expert"]), set()).add(_LEGACY_PART[match["proj"]])
    for layer, experts in sorted(layers.items()):
        count = sum(1 for name in base.modules if name.startswith(f"{layer}.mlp.experts.") and name.endswith(".down_proj"))
        if count == 0 or max(experts) >= count:
            raise InvalidArgument(f"{layer[:200]}: transformers 4 per-expert LoRA names expert {max(experts)}, but the "
                                  f"base model's {layer[:200]} has {count} experts")
        parts = set().union(*experts.values())
        short = sorted(e for e in range(count) if experts.get(e) != parts)
        if short or ("gate" in parts) != ("up" in parts):
            raise InvalidArgument(f"{layer[:200]}: transformers 4 per-expert LoRA must give every expert of a layer the "
                                  f"same parts, gate with up (PEFT stacks them); got {sorted(parts)} with expert "
                                  f"{short[0] if short else 0} differing")


def _legacy_expert_targets(legacy: dict[str, tuple[torch.Tensor, torch.Tensor]],
                           pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], settings: LoRASettings, max_rank: int,
                           base: BaseModelShapes) -> tuple[dict[str, LoRATarget], dict[str, str]]:
    """transformers 4 per-expert pairs (`legacy`; `pairs`: the adapter's other linears) as the fused
    experts' targets, as PEFT converts such an adapter for transformers 5: Mixtral's
    `block_sparse_moe.gate` is the router `mlp.gate`; w2 (Qwen's down_proj) is expert e's down_proj
    as it is; w1 and w3 (gate_proj and up_proj) become gate_up_proj with A = [A_gate; A_up]
    [r_gate + r_up, in] and B = blockdiag(B_gate, B_up) [2 * inter, r_gate + r_up]. Returns the
    targets and, for each, the key its factors came from.

    Served only where PEFT's conversion computes what the adapter computed under transformers 4:
    a family PEFT converts (`_LEGACY_CONVERTED`), no rsLoRA and no rank/alpha pattern on the
    per-expert modules (PEFT rescales or ignores them), every expert of a layer with the same parts
    and gate with up (PEFT stacks all experts and converts w3 only beside w1), and no dense MLP
    factors beside them (PEFT reads those as expert factors).

    Raises:
        InvalidArgument: any of the above, what `_build_target` refuses, parts of different input
            or output sizes, the fused rank above `max_rank`, an expert or layer the base model
            lacks, or a fused delta past the bound.
    """
    if not legacy:
        return {}, {}
    _check_legacy(legacy, pairs, settings, base)
    fused: dict[str, dict[int, LoRATarget]] = {}
    targets, sources = {}, {}
    seen: dict[tuple[str, str], str] = {}  # (expert or router, part) -> the key that gave it
    for module, (a, b) in legacy.items():
        match = _LEGACY_EXPERT.match(module)
        part = (f"{match['layer']}.{match['expert']}", "router" if match["router"] else _LEGACY_PART[match["proj"]])
        if seen.setdefault(part, module) != module:
            raise InvalidArgument(f"{module[:200]}: adapts the weight {seen[part][:200]} adapts too; each weight takes "
                                  "one pair of LoRA factors")
        prefix = f"{match['layer']}.mlp.experts.{match['expert']}"
        if match["router"]:
            name = f"{match['layer']}.mlp.gate"
            targets[name] = _build_target(name, a, b, settings, max_rank, base, pattern_name=module)
        elif match["proj"] in ("w2", "down_proj"):
            name = f"{prefix}.down_proj"
            targets[name] = _build_target(name, a, b, settings, max_rank, base, pattern_name=module)
        else:
            name = f"{prefix}.gate_up_proj"
            fused.setdefault(name, {})[_LEGACY_GATE_UP[match["proj"]]] = _build_target(
                module, a, b, settings, max_rank, None, check_bound=False)
        sources[name] = module if name not in sources else f"{sources[name]} and {module}"
    for name, parts in sorted(fused.items()):
        gate, up = parts[0], parts[1]
        if gate.lora_a.shape[1] != up.lora_a.shape[1] or gate.lora_b.shape[0] != up.lora_b.shape[0]:
            raise InvalidArgument(f"{name[:200]}: the gate part maps {gate.lora_a.shape[1]} -> {gate.lora_b.shape[0]} "
                                  f"features and the up part {up.lora_a.shape[1]} -> {up.lora_b.shape[0]}; they must agree")
        inter = gate.lora_b.shape[0]
        lora_a = torch.cat([gate.lora_a, up.lora_a])  # [r_gate + r_up, in]
        lora_b = torch.zeros(2 * inter, lora_a.shape[0])  # [2 * inter, r_gate + r_up]
        lora_b[:inter, :gate.rank], lora_b[inter:, gate.rank:] = gate.lora_b, up.lora_b
        if lora_a.shape[0] > max_rank:
            raise InvalidArgument(f"{name[:200]}: the fused gate and up parts have rank {lora_a.shape[0]}, above the "
                                  f"registry's max_rank {max_rank}")
        shape = base.modules.get(name)
        if shape is None or (lora_a.shape[1], 2 * inter) != (shape.in_features, shape.out_features):
            raise InvalidArgument(f"{name[:200]}: LoRA maps {lora_a.shape[1]} -> {2 * inter} features, which does not "
                                  "fit the base model's experts")
        _check_delta_bound(name, lora_a, lora_b.to(torch.float64), base.weight_scale(name))
        targets[name] = LoRATarget(lora_a=lora_a, lora_b=lora_b, alpha=max(gate.alpha, up.alpha))
    return targets, sources


def _is_router(module: str, settings: LoRASettings) -> bool:
    """Whether `module` is a MoE router whose weight target_parameters names ("gate.weight"): PEFT
    adapts that 2-D weight as a linear, so its pair is read as the linear `module`'s."""
    return module.endswith(".mlp.gate") and settings.targets_parameter(f"{module}.weight")


def _expert_weight_pairs(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                         settings: LoRASettings) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Take the expert-weight pairs out of `pairs` (module docstring): "<layer>.mlp.experts" plus
    n `.base_layer` wrappers -> the weight "<layer>.mlp.experts.<part>" it adapts, the parts that
    target_parameters names at that module taken in declaration order from the innermost wrapper.

    Raises:
        InvalidArgument: a wrapper depth that target_parameters does not account for.
    """
    weights = {}
    for module in sorted(pairs):
        match = _WRAPPED_EXPERTS.match(module)
        if match is None:
            continue
        group = match["module"]
        parts = [part for part in EXPERT_PARTS if settings.targets_parameter(f"{group}.{part}")]
        if not parts:
            if settings.target_parameters or match["wrappers"]:
                raise InvalidArgument(f"{module[:200]}: the weights adapt expert weights that adapter_config.json's "
                                      "target_parameters does not name")
            continue  # a module named "experts" that target_modules may name
        depth = match["wrappers"].count(".base_layer")
        if depth >= len(parts):
            raise InvalidArgument(f"{module[:200]}: {depth} base_layer wrappers, but target_parameters names "
                                  f"{len(parts)} expert weight(s) of {group[:200]}")
        weights[f"{group}.{parts[len(parts) - 1 - depth]}"] = pairs.pop(module)
    return weights


def _expert_targets(weight: str, a: torch.Tensor, b: torch.Tensor, settings: LoRASettings, max_rank: int,
                    base: BaseModelShapes) -> dict[str, LoRATarget]:
    """The per-expert targets of one expert weight's pair, A [r * E, in] and B [out, r * E]
    (module docstring), each checked as `_build_target` checks a linear's.

    Raises:
        InvalidArgument: factors that are not 2-D, rows not a multiple of the configured rank, an
            expert count the base model does not have, or what `_build_target` refuses.
    """
    group, part = weight.rsplit(".", 1)
    rank = settings.rank_for(weight)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] % rank:
        raise InvalidArgument(f"{weight[:200]}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                              f"[r * experts, in] and [out, r * experts] for r={rank} (adapter_config.json)")
    experts = a.shape[0] // rank
    count = sum(1 for name in base.modules if name.startswith(group + ".") and name.endswith("." + part))
    if count == 0:
        raise InvalidArgument(f"{weight[:200]}: the base model has no routed experts at {group[:200]} (a dense layer, "
                              "or no such layer)")
    if experts != count:
        raise InvalidArgument(f"{weight[:200]}: the factors hold {experts} experts of rank {rank}; the base model's "
                              f"{group[:200]} has {count}")
    a_e = a.reshape(experts, rank, a.shape[1])  # [E, r, in]
    b_e = b.reshape(b.shape[0], rank, experts)  # [out, r, E]
    return {f"{group}.{e}.{part}": _build_target(f"{group}.{e}.{part}", a_e[e], b_e[:, :, e], settings, max_rank,
                                                 base, pattern_name=weight)
            for e in range(experts)}


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pattern(config: dict, field_name: str, valid, expected: str) -> dict:
    """`config[field_name]` ({module regex: value}) checked: an object of compilable regexes to valid values."""
    pattern = config.get(field_name) or {}
    if not isinstance(pattern, dict):
        raise InvalidArgument(f"adapter_config.json: {field_name} must be an object, got {_clip(pattern)}")
    if len(pattern) > MAX_CONFIG_ENTRIES:
        raise InvalidArgument(f"adapter_config.json: {field_name} has {len(pattern)} entries; the limit is "
                              f"{MAX_CONFIG_ENTRIES}")
    for key, value in pattern.items():
        try:
            re.compile(_pattern_regex(key))
        except re.error as error:
            raise InvalidArgument(f"adapter_config.json: {field_name} key {_clip(key)} is not a valid regular "
                                  f"expression ({error})") from None
        if not valid(value):
            raise InvalidArgument(f"adapter_config.json: {field_name}[{_clip(key)}]={_clip(value)} must be {expected}")
    return dict(pattern)


def _clip(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (config values are client input and may be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _refuse_unsupported(config: dict) -> None:
    if config.get("peft_type") != "LORA":
        raise InvalidArgument(f"adapter_config.json: peft_type={_clip(config.get('peft_type'))} is not supported; "
                              "only 'LORA' adapters can be loaded")
    refusals = {
        "use_dora": "DoRA adds a magnitude vector the decoder does not apply",
        "modules_to_save": "saved full modules would replace base weights",
        "fan_in_fan_out": "transposed (Conv1D) factors are not supported",
        "lora_bias": "trained LoRA biases are not supported",
        "trainable_token_indices": "trainable token embeddings are not supported",
        "layer_replication": "layer replication changes the base model",
    }
    for field_name, reason in refusals.items():
        if config.get(field_name):
            raise InvalidArgument(f"adapter_config.json: {field_name}={_clip(config[field_name])} is not supported; {reason}")
    if config.get("bias", "none") != "none":
        raise InvalidArgument(f"adapter_config.json: bias={_clip(config['bias'])} is not supported; only 'none' "
                              "(trained biases would change the base layers)")


def _refuse_embedding_targets(targets: TargetModules) -> None:
    embedded = sorted(t for t in targets.targets.names if t.rsplit(".", 1)[-1] in _EMBEDDING_NAMES)
    if embedded:
        raise InvalidArgument(f"adapter_config.json: target_modules includes {embedded}; embedding and lm_head "
                              "targets are not supported")


def _load_tensors(data: bytes) -> dict[str, torch.Tensor]:
    try:
        return load(data)
    except (SafetensorError, ValueError) as error:
        raise InvalidArgument(f"{WEIGHTS_FILE} is not a readable safetensors file: {error}") from None


def _pair_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (lora_A.weight, lora_B.weight); every tensor must belong to exactly one pair."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    extra = []
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            extra.append(key)
            continue
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if extra:
        kind = "embedding LoRA tensors" if any("lora_embedding" in k for k in extra) else "unexpected tensors"
        raise InvalidArgument(f"{WEIGHTS_FILE} holds {kind} {sorted(extra)[:4]}; only "
                              "base_model.model.<module>.lora_A.weight / .lora_B.weight are accepted")
    if not parts:
        raise InvalidArgument(f"{WEIGHTS_FILE} holds no LoRA tensors")
    for module, pair in sorted(parts.items()):
        missing = {"A", "B"} - set(pair)
        if missing:
            raise InvalidArgument(f"{module}: lora_{missing.pop()}.weight is missing; A and B come in pairs")
        if module.rsplit(".", 1)[-1] in _EMBEDDING_NAMES:
            raise InvalidArgument(f"{module}: embedding and lm_head targets are not supported")
    return {module: (pair["A"], pair["B"]) for module, pair in parts.items()}


def _build_target(module: str, a: torch.Tensor, b: torch.Tensor, settings: LoRASettings, max_rank: int,
                  base: BaseModelShapes | None, pattern_name: str | None = None, check_bound: bool = True) -> LoRATarget:
    """Check one pair (A [r, in], B [out, r]) and return it in float32 with B scaled. Rank and
    alpha are those rank_pattern / alpha_pattern give `pattern_name` (default `module`);
    `check_bound` false leaves the delta bound to the caller (a part of a fused target)."""
    pattern_name = pattern_name or module
    for part, tensor in (("A", a), ("B", b)):
        if tensor.dim() != 2:
            raise InvalidArgument(f"{module}: lora_{part} has shape {tuple(tensor.shape)}; expected 2-D")
        if tensor.dtype not in _FLOAT_DTYPES:
            raise InvalidArgument(f"{module}: lora_{part} has dtype {tensor.dtype}; expected a float dtype")
    rank, in_features = a.shape
    out_features = b.shape[0]
    if not (in_features and out_features):
        raise InvalidArgument(f"{module}: lora_A is {tuple(a.shape)} and lora_B is {tuple(b.shape)}; factors must not "
                              "be empty")
    if b.shape[1] != rank:
        raise InvalidArgument(f"{module}: lora_A is {tuple(a.shape)} and lora_B is {tuple(b.shape)}; ranks differ")
    if not 1 <= rank <= max_rank:
        raise InvalidArgument(f"{module}: rank {rank} exceeds the registry's max_rank {max_rank}")
    if rank != settings.rank_for(pattern_name):
        raise InvalidArgument(f"{module}: tensors have rank {rank} but adapter_config.json (r/rank_pattern) "
                              f"says {settings.rank_for(pattern_name)}")
    if base is not None:
        shape = base.modules.get(module)
        if shape is None:
            raise InvalidArgument(f"target {module} matches no linear module of the base model")
        if (in_features, out_features) != (shape.in_features, shape.out_features):
            raise InvalidArgument(f"{module}: LoRA maps {in_features} -> {out_features} features but the base "
                                  f"model's layer is {shape.in_features} -> {shape.out_features}")
    alpha = settings.alpha_for(pattern_name)
    scaled_b = b.to(torch.float64) * settings.scale(rank, alpha)  # [out, r]
    lora_a = a.to(torch.float32).contiguous()  # [r, in]
    lora_b = scaled_b.to(torch.float32).contiguous()  # [out, r]
    if not (torch.isfinite(a).all() and torch.isfinite(b).all() and torch.isfinite(lora_b).all()):
        raise InvalidArgument(f"{module}: LoRA weights contain non-finite values")
    if check_bound:
        _check_delta_bound(module, a, scaled_b, None if base is None else base.weight_scale(module))
    return LoRATarget(lora_a=lora_a, lora_b=lora_b, alpha=alpha)


def _check_delta_bound(module: str, a: torch.Tensor, scaled_b: torch.Tensor, base_scale: float | None) -> None:
    """Refuse a delta past the bound of the module docstring (O(out*r + r*in), no [out, in] product)."""
    row_max_a = a.to(torch.float64).abs().amax(dim=1)  # [r]
    bound = float((scaled_b.abs() @ row_max_a).max())  # >= max |B' A|
    scale = 1.0 if base_scale is None else base_scale
    limit = DELTA_SCALE_FACTOR * scale
    if not math.isfinite(bound) or bound > limit:
        of = "the base layer's max |W|" if base_scale is not None else "an assumed base max |W|"
        raise InvalidArgument(f"{module}: the effective LoRA delta (scale * B @ A) reaches up to {bound:.3g}; the "
                              f"limit is {limit:.3g} ({DELTA_SCALE_FACTOR:g} x {of} {scale:.3g}), past which it "
                              "overflows the decoder's compute range")
    for part, factor in (("lora_A", row_max_a.max()), ("scale * lora_B", scaled_b.abs().max())):
        if float(factor) > FACTOR_LIMIT:  # a small product of one huge and one tiny factor
            raise InvalidArgument(f"{module}: {part} reaches {float(factor):.3g}; the limit is {FACTOR_LIMIT:g} per "
                                  "value, past which the shrink x @ A^T (or its expand) leaves float32's range "
                                  "before the product is small again")
