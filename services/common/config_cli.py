"""Command lines generated from config dataclasses, as vLLM's `EngineArgs` does.

A config field becomes a flag when its metadata has a "help" entry:

    max_wait_ms: float = field(default=2.0, metadata={"help": "longest hold before a forward (ms)"})

Metadata keys:
    help: the flag's help text; the default is appended ("(default: 2.0)").
    env: an environment variable that, when set, replaces the default (and is named in the help).
    choices: the values the flag accepts.
    flag: the flag's name when it is not `--field-name` (e.g. "--prefix-caching" for
        `enable_prefix_caching`; a bool flag always has its `--no-` form too).
    type: a function parsing the flag's text, for fields whose type is not int, float, str or Path
        (e.g. an M-RoPE section "8,12,12"); it raises ValueError or argparse.ArgumentTypeError.
    append: True for a repeatable flag collecting a list.
    nargs: "+" for a flag taking one or more values at once into a list (vLLM's
        `--served-model-name NAME [ALIAS ...]`); the values' type comes from the list's annotation,
        as for append. Such a field takes no "env".
    metavar: the value's name in the help; a pair names the first and the further values of
        nargs "+" (("NAME", "ALIAS") shows `NAME [ALIAS ...]`).
    default_help: what the help shows as the default, where the field default says less
        (e.g. "each model's max_seq_length" for None).

The flag's type comes from the field's annotation: int, float, str, Path (or `X | None` of them);
bool gives `--x / --no-x`. Fields without "help" (nested configs, derived values) get no flag.
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Callable
from dataclasses import MISSING, Field, fields
from pathlib import Path
from types import NoneType, UnionType
from typing import Any


def flag(name: str) -> str:
    """The CLI flag of config field `name`: max_name_chars -> --max-name-chars."""
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type, defaults: Any = None) -> None:
    """One flag per field of dataclass `cls` that has metadata "help".

    `defaults`: an instance whose values replace the field defaults. A flag the parser already has
    is kept: two configs' fields of one name are one setting (the gateway's --max-name-chars covers
    Generate's and the pooling RPCs' names alike).

    Raises:
        TypeError: a flagged field whose type has no parser and no "type" metadata.
    """
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if "help" not in f.metadata:
            continue
        name = f.metadata.get("flag", flag(f.name))
        if name in parser._option_string_actions:  # argparse has no public lookup
            continue
        default = getattr(defaults, f.name) if defaults is not None else _field_default(f)
        parser.add_argument(name, dest=f.name, **_argument(f, hints[f.name], default))


def from_flags(cls: type, args: argparse.Namespace, **overrides: Any):
    """The `cls` instance the flags of `add_flags` describe; `overrides` set the fields without flags.

    Raises:
        ValueError: from `cls.__post_init__`.
    """
    return cls(**flag_values(cls, args), **overrides)


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """Field name -> parsed value, for the flagged fields of `cls`."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if "help" in f.metadata}


def _field_default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def _argument(f: Field, annotation: Any, default: Any) -> dict[str, Any]:
    meta = f.metadata
    env = meta.get("env")
    base = _base_type(annotation)
    parse = meta.get("type") or (base if base in (int, float, str, Path) else None)
    if env and os.environ.get(env) is not None:
        text = os.environ[env]
        if base is bool:
            default = text.strip().lower() in ("1", "true", "yes", "on")
        else:  # a string default: argparse parses it as the flag's value, and refuses a bad one in one line
            default, parse = text, _from_env(parse or str, env, text)
    shown = meta.get("default_help", "%(default)s")
    source = f"; ${env} when set" if env else ""
    kwargs: dict[str, Any] = {"default": default, "help": f"{meta['help']} (default: {shown}{source})"}
    if "choices" in meta:
        kwargs["choices"] = meta["choices"]
    if "metavar" in meta:
        kwargs["metavar"] = meta["metavar"]
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
        return kwargs
    if meta.get("append") or meta.get("nargs"):
        if meta.get("nargs"):
            kwargs["nargs"] = meta["nargs"]
        else:
            kwargs["action"] = "append"
        kwargs["default"] = list(default or [])
        base = _base_type(typing.get_args(annotation)[0]) if typing.get_args(annotation) else str
        parse = meta.get("type") or base
    if parse is None:
        raise TypeError(f"{f.name}: a {annotation} field needs a 'type' entry in its metadata to be a flag")
    kwargs["type"] = parse
    return kwargs


def _from_env(parse: Callable[[str], Any], env: str, text: str) -> Callable[[str], Any]:
    """`parse`, whose refusal of `text` (the default, from $env) names the variable."""
    def parse_value(value: str) -> Any:
        try:
            return parse(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as error:
            if value is text:
                raise argparse.ArgumentTypeError(f"${env}={text!r} is not a valid value ({error})") from None
            raise
    parse_value.__name__ = getattr(parse, "__name__", "value")  # argparse's "invalid int value" names it
    return parse_value


def _base_type(annotation: Any) -> Any:
    """`X | None` -> X; other annotations as they are."""
    if typing.get_origin(annotation) in (UnionType, typing.Union):
        args = [a for a in typing.get_args(annotation) if a is not NoneType]
        return args[0] if len(args) == 1 else annotation
    return annotation
