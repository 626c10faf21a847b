"""Flags generated from config fields (services/common/config_cli.py), and statuses mapped back to
domain errors from the one table (services/common/errors.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from services.common import errors
from services.common.config_cli import add_flags, from_flags
from services.common.mrope import parse_mrope_section


@dataclass
class _Config:
    port: int = field(default=7, metadata={"help": "a port", "env": "TESSERA_TEST_PORT"})
    mode: str = field(default="a", metadata={"help": "a mode", "choices": ("a", "b")})
    caching: bool = field(default=True, metadata={"help": "cache", "flag": "--prefix-caching"})
    model_dir: list[Path] = field(default_factory=list, metadata={"help": "dirs", "append": True})
    section: tuple[int, int, int] | None = field(default=None, metadata={"help": "s", "type": parse_mrope_section})
    width: float | None = field(default=None, metadata={"help": "w"})
    derived: int = 0  # no "help": no flag


def _parse(argv: list[str]) -> _Config:
    parser = argparse.ArgumentParser()
    add_flags(parser, _Config)
    return from_flags(_Config, parser.parse_args(argv))


def test_flags_take_types_choices_and_names_from_the_fields(monkeypatch):
    monkeypatch.delenv("TESSERA_TEST_PORT", raising=False)
    assert _parse([]) == _Config()
    config = _parse(["--port", "9", "--mode", "b", "--no-prefix-caching", "--model-dir", "x", "--model-dir", "y",
                     "--section", "8,12,12", "--width", "0.5"])
    assert config == _Config(port=9, mode="b", caching=False, model_dir=[Path("x"), Path("y")],
                             section=(8, 12, 12), width=0.5)
    with pytest.raises(SystemExit):
        _parse(["--mode", "c"])
    with pytest.raises(SystemExit):
        _parse(["--derived", "1"])


@dataclass
class _Names:
    served_model_name: list[str] = field(default_factory=list, metadata={
        "help": "names", "nargs": "+", "metavar": ("NAME", "ALIAS")})


def test_a_nargs_flag_takes_one_or_more_values_into_a_list():
    parser = argparse.ArgumentParser()
    add_flags(parser, _Names)
    assert from_flags(_Names, parser.parse_args([])).served_model_name == []
    assert from_flags(_Names, parser.parse_args(["--served-model-name", "org/m", "m", "mm"])).served_model_name == \
        ["org/m", "m", "mm"]
    assert "--served-model-name NAME [ALIAS ...]" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--served-model-name"])


def test_an_env_var_replaces_the_default_and_a_flag_wins(monkeypatch):
    monkeypatch.setenv("TESSERA_TEST_PORT", "11")
    assert _parse([]).port == 11
    assert _parse(["--port", "12"]).port == 12


def test_a_bad_env_var_is_refused_in_one_line_naming_it(monkeypatch, capsys):
    """It was int('abc') raised while the parser was built: a traceback."""
    monkeypatch.setenv("TESSERA_TEST_PORT", "abc")
    assert _parse(["--port", "9"]).port == 9  # a flag given replaces it: never parsed
    with pytest.raises(SystemExit) as exit_:
        _parse([])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: argument --port: $TESSERA_TEST_PORT='abc' is not a valid value (invalid literal for int() with "
        "base 10: 'abc')")


def test_help_shows_each_default_and_its_env_var(monkeypatch):
    monkeypatch.delenv("TESSERA_TEST_PORT", raising=False)
    parser = argparse.ArgumentParser()
    add_flags(parser, _Config)
    text = " ".join(parser.format_help().split())
    assert "a port (default: 7; $TESSERA_TEST_PORT when set)" in text
    assert "a mode (default: a)" in text


@pytest.mark.parametrize("error", errors.ERRORS)
def test_every_domain_error_survives_a_round_trip_through_its_status(error):
    code, message = errors.status_of(error("name 'x' is unknown"))
    back = errors.error_of(code, message)
    assert type(back) is error and str(back) == "name 'x' is unknown"


def test_a_status_without_a_domain_error_is_internal_and_named():
    back = errors.error_of(grpc.StatusCode.UNIMPLEMENTED, "no such method")
    assert isinstance(back, errors.Internal) and str(back) == "UNIMPLEMENTED: no such method"
