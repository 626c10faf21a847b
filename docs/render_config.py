"""docs/reference/configuration.md: every service's flags, `tessera up`'s, and the environment.

Flags come from each service's own `build_parser()` (tessera/<name>/__main__.py), which
services/common/config_cli.py fills from the config dataclasses' field metadata; each flag's env
variable, raw default and choices are read from that metadata, so the page shows defaults as
written in the code, not as this shell's environment would change them. Environment variables are
found in the source (os.environ / os.getenv reads, config metadata "env" entries).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import itertools
import sys
import types
from pathlib import Path
from typing import Any

from services.common.config_cli import _field_default
from tessera.paths import tessera_home

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("gateway", "vision", "decoder", "pooling", "adapters")
SOURCE_DIRS = ("tessera", "services")
# What each variable read outside config metadata does; the where column comes from the source.
ENV_MEANINGS = {
    "TESSERA_HOME": "root of prepared models (`models/`) and the default adapter root (`adapters/`); "
                    "default `~/.cache/tessera`",
    "TESSERA_INTERNAL_TOKEN_FILE": "file holding the cluster's internal token (every service; `tessera up` "
                                   "writes one and sets it)",
    "TESSERA_ADMIN_TOKEN": "adapter registry: bearer token for LoadAdapter/UnloadAdapter; client: the token sent",
    "TESSERA_ADMIN_TOKEN_FILE": "a file holding the admin token: the registry's `--admin-token-file`, "
                                "and `tessera up` and `tessera adapters load/unload` read it",
    "TESSERA_ADDRESS": "`tessera` client commands: the gateway's host:port (default `localhost:50051`)",
    "TESSERA_API_TOKEN": "client: bearer token sent on every call",
    "TESSERA_TLS_ROOT_CERT": "client: PEM root certificate; the connection uses TLS",
    "OMP_NUM_THREADS": "`tessera up`: when set, replicas keep it instead of one thread each",
    "TRITON_INTERPRET": "decoder: `1` lets the Triton attention and LoRA backends run in Triton's CPU interpreter "
                        "(without it and without a CUDA device they are refused at start)",
    "CC": "decoder: C compiler for the native kernels (default `cc`)",
    "TESSERA_CPU_KERNELS": "decoder: `portable` builds the C kernels without AVX512-BF16 code on any CPU",
    "GOMP_SPINCOUNT": "set to 20000 for every service `tessera up` starts unless already set "
                      "(bench/results/settings.md)",
}


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _shown(value: Any) -> str:
    """A default as the page shows it: paths under $TESSERA_HOME named by the variable, not this machine."""
    if value is None or value == "":
        return "" if value is None else '`""`'
    text = str(value)
    home = str(tessera_home())
    if text.startswith(home):
        text = "$TESSERA_HOME" + text[len(home):]
    if isinstance(value, (list, tuple)) and not value:
        return ""
    return f"`{text}`"


def _config_fields(module) -> dict[str, dataclasses.Field]:
    """dest -> field, for every flagged field of the config dataclasses `module` builds flags from
    (its own names, then those of the services.common modules loaded with it, e.g. logs.LogConfig,
    whose flags services.common.run adds to every service)."""
    found: dict[str, dataclasses.Field] = {}
    common = [vars(value).values() for name, value in sorted(sys.modules.items())
              if isinstance(value, types.ModuleType) and name.startswith("services.common.")]
    for value in itertools.chain(vars(module).values(), *common):
        if isinstance(value, type) and dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                if "help" in f.metadata:
                    found.setdefault(f.name, f)
    return found


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "bool"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "switch"
    kind = getattr(action.type, "__name__", "str") if action.type else "str"
    kind = kind if kind in ("int", "float", "str", "Path") else "str"  # a custom parser still reads text
    if action.nargs == "+":
        return f"{kind}, one or more"
    return f"{kind}, repeatable" if isinstance(action, argparse._AppendAction) else kind


def _flag_rows(parser: argparse.ArgumentParser, fields: dict[str, dataclasses.Field],
               flag_env: dict[str, list[str]], where: str) -> list[str]:
    """The flags table; each flag's env variable is also added to `flag_env` (variable -> flags)."""
    rows = ["| flag | type | default | env | choices | meaning |", "|---|---|---|---|---|---|"]
    for action in parser._actions:  # argparse has no public list of its arguments
        if (not action.option_strings or isinstance(action, argparse._HelpAction)
                or action.help == argparse.SUPPRESS):  # a removed flag kept only to refuse it
            continue
        f = fields.get(action.dest)
        if f is not None:
            meta = f.metadata
            default = meta.get("default_help") or _shown(_field_default(f))
            env, help_text = meta.get("env", ""), meta["help"]
        else:
            default, env = _shown(action.default), ""
            help_text = (action.help or "").replace("%(default)s", str(action.default))
        flags = " / ".join(f"`{o}`" for o in action.option_strings)
        if env:
            flag_env.setdefault(env, []).append(f"{action.option_strings[0]} ({where})")
        choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
        rows.append(f"| {flags} | {_kind(action)} | {_cell(default)} | {f'`{env}`' if env else ''} | "
                    f"{choices} | {_cell(help_text)} |")
    return rows


def _up_parser() -> argparse.ArgumentParser:
    from tessera.cli.main import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["up"]
    raise LookupError("tessera's parser has no `up` command")


def _constants(tree: ast.Module) -> dict[str, str]:
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" or isinstance(node, ast.Name) and \
        node.id == "environ"


def environment_reads() -> dict[str, list[str]]:
    """Variable -> the files that read it (os.environ.get/[]/in, os.getenv), in the source dirs."""
    trees = {p: ast.parse(p.read_text()) for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))}
    names: dict[str, str] = {}
    for tree in trees.values():
        names.update({k: v for k, v in _constants(tree).items() if k.endswith("_ENV")})
    reads: dict[str, list[str]] = {}
    for path, tree in trees.items():
        local = {**names, **_constants(tree)}
        for node in ast.walk(tree):
            key = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                    node.func.attr == "get" and _is_environ(node.func.value) or node.func.attr == "getenv"):
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
                key = node.slice
            elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
                key = node.left
            name = key.value if isinstance(key, ast.Constant) else local.get(getattr(key, "id", None))
            if isinstance(name, str):
                reads.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return reads


def _environment_section(flag_env: dict[str, list[str]]) -> list[str]:
    lines = ["## Environment variables", "",
             "A flag's variable (the `env` column above) replaces the flag's default when set; the flag itself "
             "wins.", "",
             "| variable | default of |", "|---|---|"]
    for name in sorted(flag_env):
        lines.append(f"| `{name}` | {', '.join(f'`{f}`' for f in flag_env[name])} |")
    lines += ["", "Read by the code directly:", "", "| variable | meaning | read in |", "|---|---|---|"]
    from services.common.launch import SERVICE_ENV_DEFAULTS

    reads = environment_reads()
    for name in SERVICE_ENV_DEFAULTS:
        reads.setdefault(name, []).append("services/common/launch.py (SERVICE_ENV_DEFAULTS)")
    for name in sorted(reads):
        where = ", ".join(f"`{w}`" for w in dict.fromkeys(reads[name]))
        lines.append(f"| `{name}` | {_cell(ENV_MEANINGS.get(name, ''))} | {where} |")
    return lines + [""]


def render_configuration_reference() -> str:
    """The markdown of docs/reference/configuration.md."""
    flag_env: dict[str, list[str]] = {}
    lines = ["# Configuration reference", "",
             "Generated by `python docs/generate.py` from each service's command line (its config dataclasses' "
             "field metadata, services/common/config_cli.py) and `tessera up`'s parser; edit those, not this file. "
             "`python -m tessera.<name> --help` prints the same flags.", ""]
    for name in SERVICES:
        module = importlib.import_module(f"services.{name}.__main__")
        lines += [f"## {name}: `python -m services.{name}`", "",
                  _cell(module.__doc__.strip().splitlines()[0]) if module.__doc__ else "", ""]
        lines += _flag_rows(module.build_parser(), _config_fields(module), flag_env, name) + [""]
    lines += ["## `tessera up`", "",
              "Starts the five services on one host (tessera/cli/up/); `--service-args SERVICE=ARGS` passes any "
              "flag above to one service.", ""]
    lines += _flag_rows(_up_parser(), {}, flag_env, "tessera up") + [""]
    return "\n".join(lines + _environment_section(flag_env)).rstrip() + "\n"
