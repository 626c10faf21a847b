"""`target_modules` of a PEFT LoRA config, matched against module names as PEFT matches them.

PEFT's `check_target_module_exists`: a string is a regular expression that must match the whole
module name; a list names modules by their last dotted components (an entry matches a module equal
to it or ending in "." + entry). "all-linear" names every linear layer but the output head; here,
the Llama-family projections. `exclude_modules` (same two forms) removes modules, and
`layers_to_transform` keeps only those decoder layers ("...layers.<i>...").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import regex

from services.common.errors import InvalidArgument

ALL_LINEAR = "all-linear"
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


# One module name against one adapter_config.json regex: microseconds for any real pattern. A pattern
# that backtracks catastrophically ("(.*)*Q") would hold the registry's thread for ever (Python's
# re cannot be interrupted); the `regex` package's matcher (re's syntax) stops at this timeout.
MATCH_TIMEOUT_S = 0.05
# entries of one list or object of adapter_config.json (target_modules, target_parameters, rank_pattern,
# ...): a model's every module by name is a few thousand; past that a config is not an adapter's
MAX_CONFIG_ENTRIES = 4096


def match_module(pattern: str, module: str, field_name: str, whole: bool = True) -> bool:
    """Whether `pattern` matches `module` (the whole name, or from its start: re.fullmatch / re.match).

    Raises:
        InvalidArgument: the match did not finish in MATCH_TIMEOUT_S, naming `field_name` and the pattern.
    """
    try:
        found = (regex.fullmatch if whole else regex.match)(pattern, module, timeout=MATCH_TIMEOUT_S)
    except TimeoutError:
        raise InvalidArgument(f"adapter_config.json: {field_name} pattern {_clip(repr(pattern))} took more than "
                              f"{MATCH_TIMEOUT_S * 1000:.0f} ms to match module name {module!r} (catastrophic "
                              "backtracking); simplify the regular expression") from None
    return found is not None


@dataclass(frozen=True)
class ModuleSelector:
    """One of PEFT's two forms: a whole-name regex, or names matched at a dot boundary."""

    regex: str | None = None
    names: tuple[str, ...] = ()
    field_name: str = "target_modules"  # where the regex came from, for a refusal

    def matches(self, module: str) -> bool:
        """Raises InvalidArgument when the regex takes too long (`match_module`)."""
        if self.regex is not None:
            return match_module(self.regex, module, self.field_name)
        return any(module == name or module.endswith("." + name) for name in self.names)

    def entries(self) -> list[ModuleSelector]:
        """One selector per list entry (a regex is one entry)."""
        return [self] if self.regex is not None else [ModuleSelector(names=(name,)) for name in self.names]

    def describe(self) -> str:
        return repr(self.regex) if self.regex is not None else repr(self.names[0] if len(self.names) == 1 else list(self.names))


@dataclass(frozen=True)
class TargetModules:
    """The modules a LoRA config adapts (PEFT's target_modules, exclude_modules, layers_to_transform)."""

    targets: ModuleSelector
    excluded: ModuleSelector | None = None
    layers: frozenset[int] | None = None

    def matches(self, module: str) -> bool:
        if self.excluded is not None and self.excluded.matches(module):
            return False
        if not self.targets.matches(module):
            return False
        if self.layers is None:
            return True
        index = _LAYER_INDEX.search(module)
        return index is not None and int(index.group(1)) in self.layers

    def check_against(self, modules: Iterable[str]) -> None:
        """Refuse a target entry that matches none of `modules` (the base model's linears).

        Raises:
            InvalidArgument: naming the first entry that matches nothing, as PEFT refuses a config
                whose target_modules are not found in the base model.
        """
        modules = list(modules)
        # names matched at a dot boundary, no exclusions or layer filter: one set of every module's
        # dotted suffixes answers each entry (a MoE base has tens of thousands of modules)
        suffixes = None
        if self.targets.regex is None and self.excluded is None and self.layers is None:
            suffixes = {".".join(parts[i:]) for parts in (m.split(".") for m in modules) for i in range(len(parts))}
        for entry in self.targets.entries():
            if suffixes is not None:
                if entry.names[0] not in suffixes:
                    raise InvalidArgument(f"adapter_config.json: target_modules entry {_clip(entry.describe())} "
                                          "matches no linear module of the base model")
                continue
            if not any(TargetModules(entry, self.excluded, self.layers).matches(m) for m in modules):
                raise InvalidArgument(f"adapter_config.json: target_modules entry {_clip(entry.describe())} matches "
                                      "no linear module of the base model")

    @classmethod
    def from_config(cls, config: dict, required: bool = True) -> TargetModules:
        """Parse target_modules (required unless `required` is false: an adapter of PEFT's
        target_parameters alone), exclude_modules and layers_to_transform.

        Raises:
            InvalidArgument: a missing (when required), empty or malformed field, naming it.
        """
        targets = _selector(config, "target_modules")
        if targets is None and not required:
            targets = ModuleSelector()
        if targets is None:
            raise InvalidArgument("adapter_config.json: target_modules is missing or empty; it must name the "
                                  "modules the LoRA weights adapt")
        return cls(targets, _selector(config, "exclude_modules"), _layers(config))


def _selector(config: dict, field_name: str) -> ModuleSelector | None:
    value = config.get(field_name)
    if value is None or value == [] or value == "":
        return None
    if value == ALL_LINEAR:
        return ModuleSelector(names=LINEAR_NAMES)
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as error:
            raise InvalidArgument(f"adapter_config.json: {field_name}={_clip(repr(value))} is not a valid regular "
                                  f"expression ({error})") from None
        return ModuleSelector(regex=value, field_name=field_name)
    if not isinstance(value, list) or not all(isinstance(name, str) and name for name in value):
        raise InvalidArgument(f"adapter_config.json: {field_name}={_clip(repr(value))} must be a string or a list "
                              "of non-empty strings")
    if len(value) > MAX_CONFIG_ENTRIES:
        raise InvalidArgument(f"adapter_config.json: {field_name} has {len(value)} entries; the limit is "
                              f"{MAX_CONFIG_ENTRIES}")
    return ModuleSelector(names=tuple(value))


def _layers(config: dict) -> frozenset[int] | None:
    value = config.get("layers_to_transform")
    if value is None or value == []:
        return None
    values = [value] if isinstance(value, int) else value
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in values):
        raise InvalidArgument(f"adapter_config.json: layers_to_transform={_clip(repr(value))} must be a layer index "
                              "or a list of them")
    return frozenset(values)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
