"""The `tessera` command line without a cluster: where --address goes, what --help and --version
show, which modules a client command imports, and how errors read to a CLI user."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from services.common.launch import free_port
from tessera import protocol
from tessera.cli.client import check_address, explain
from tessera.cli.main import build_parser, main
from tessera.client import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera.cli.main", *argv], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_address_before_or_after_the_command_and_from_the_environment(monkeypatch):
    monkeypatch.delenv("TESSERA_ADDRESS", raising=False)
    assert build_parser().parse_args(["info"]).address == "localhost:50051"
    assert build_parser().parse_args(["--address", "h:1", "info"]).address == "h:1"
    assert build_parser().parse_args(["info", "--address", "h:2"]).address == "h:2"
    assert build_parser().parse_args(["--address", "h:1", "adapters", "list", "--address", "h:3"]).address == "h:3"
    monkeypatch.setenv("TESSERA_ADDRESS", "env-host:7")
    assert build_parser().parse_args(["generate", "hi"]).address == "env-host:7"
    assert build_parser().parse_args(["generate", "hi", "--address", "h:2"]).address == "h:2"


@pytest.mark.parametrize("address", ["localhost:", "host:http", "host:0", "host:70000", "::1", "dns:///localhost"])
def test_an_address_without_a_valid_port_is_refused(address):
    with pytest.raises(ValueError, match="needs host:port"):
        check_address(address)


def test_localhost_without_a_port_is_refused_in_one_line():
    result = _run("info", "--address", "localhost")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "needs host:port" in result.stderr and "443" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("address", ["localhost:50051", "10.0.0.1:1", "[::1]:50051", "dns:///gateway:50051",
                                     "ipv4:10.0.0.1:1,10.0.0.2:1"])
def test_addresses_with_a_port_pass(address):
    assert check_address(address) == address


def test_n_below_one_is_refused_before_any_call(capsys):
    assert main(["generate", "hi", "--n", "0", "--address", f"127.0.0.1:{free_port()}"]) == 2
    assert capsys.readouterr().err == "error: --n is 0; at least 1\n"


def test_version_is_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"tessera {version('tessera')}\n"


def _parsers(parser: argparse.ArgumentParser, prog: str = "tessera"):
    yield prog, parser
    for action in parser._actions:  # argparse lists subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{prog} {name}")


def test_every_option_with_a_value_shows_its_default_in_help():
    missing = []
    for prog, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.help == argparse.SUPPRESS:
                continue
            if "default" not in formatter._get_help_string(action):
                missing.append(f"{prog} {action.option_strings[0]}")
    assert missing == []
    help_text = " ".join(_run("adapters", "load", "--help").stdout.split())  # a parser two levels down
    assert "(default: $TESSERA_ADDRESS, else localhost:50051)" in help_text
    help_text = " ".join(_run("generate", "--help").stdout.split())
    assert "(default: 64)" in help_text and "default: off)" in help_text


def test_a_secret_flag_is_refused_without_echoing_the_secret(capsys):
    from services.adapters.__main__ import build_parser as registry_parser

    for parse in (lambda: main(["up", "--admin-token", "s3cret-value"]),
                  lambda: main(["adapters", "load", "a", "b", "--admin-token", "s3cret-value"]),
                  lambda: registry_parser().parse_args(["--admin-token", "s3cret-value"])):
        with pytest.raises(SystemExit) as exit_:
            parse()
        assert exit_.value.code == 2
        out, err = capsys.readouterr()
        assert "--admin-token-file" in err and "s3cret-value" not in out + err


# Every client command, against an address where nothing listens, in one interpreter; then the
# modules it loaded. `up --help` builds the server commands' parser too.
CLIENT_RUN = """
import json, sys
from tessera.cli.main import main
address = sys.argv[1]
codes = []
for argv in (["generate", "hi", "--n", "2", "--logprobs", "1", "--system", "be brief"], ["embed", "a", "b"],
             ["rerank", "q", "d"], ["tokenize", "a"], ["info"], ["info", "--json"], ["adapters", "list"],
             ["adapters", "unload", "x"], ["up", "--help"], ["generate", "--help"]):
    try:
        codes.append(main([*argv, "--address", address]) if "--help" not in argv else main(argv))
    except SystemExit as exit_:
        codes.append(exit_.code)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "safetensors", "PIL")
               or m.split(".")[:2] in (["tessera", s] for s in ("decoder", "gateway", "pooling", "vision", "adapters"))
               or (m.startswith("services.common.") and m != "tessera.paths"))
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def test_client_commands_import_no_torch_transformers_or_service_code():
    address = f"127.0.0.1:{free_port()}"
    result = subprocess.run([sys.executable, "-c", CLIENT_RUN, address], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["heavy"] == []
    assert report["codes"] == [1] * 8 + [0, 0]
    refusals = result.stderr.splitlines()
    assert refusals == [f"error: no tessera cluster is running at {address} (start one with `tessera up`)"] * 8


def test_errors_name_the_flag_or_variable_to_set():
    remote = argparse.Namespace(address="gw:1", command="generate")
    admin = argparse.Namespace(address="gw:1", command="adapters", action="load")
    grpc_refused = "failed to connect to all addresses; last error: UNKNOWN: ipv4:1.2.3.4:1: Connection refused"
    assert explain(Unavailable(grpc_refused), remote) == \
        "no tessera cluster is running at gw:1 (start one with `tessera up`)"
    assert explain(Unavailable("decoder service at x:1 is unavailable: boom"), remote) == \
        "UNAVAILABLE: decoder service at x:1 is unavailable: boom"  # the cluster runs; one service does not
    assert explain(Unauthenticated("this gateway needs an API key: metadata 'authorization: Bearer <key>'",
                                   reason=protocol.API_KEY_MISSING),
                   remote) == "the gateway at gw:1 needs an API key: set TESSERA_API_TOKEN"
    assert explain(Unauthenticated("the API key is not valid", reason=protocol.API_KEY_INVALID), remote) == \
        "the gateway at gw:1 refused the API key in TESSERA_API_TOKEN"
    assert "set TESSERA_ADMIN_TOKEN or pass --admin-token-file" in explain(
        Unauthenticated("this RPC is an admin operation; send metadata 'authorization: Bearer <token>'"), admin)
    assert explain(PermissionDenied("admin token is not valid for this registry"), admin).startswith(
        "the adapter registry refused the admin token: set TESSERA_ADMIN_TOKEN or pass --admin-token-file")
    assert explain(AlreadyExists("adapter 'a' exists (generation 1); pass replace=true to load new weights under "
                                 "this name"), admin).endswith("pass --replace to load new weights under this name")
    assert "pass --drain to refuse" in explain(FailedPrecondition(
        "adapter 'a' is leased by 1 request(s); pass drain=true to refuse new requests and wait"), admin)
    assert explain(InvalidArgument("sampling.top_logprobs is 50; the limit is 20; sampling.max_tokens is 9"),
                   remote) == "INVALID_ARGUMENT: --logprobs is 50; the limit is 20; --max-tokens is 9"
    assert "internal ports" in explain(Unauthenticated("this is an internal port; metadata is missing",
                                                       reason=protocol.INTERNAL_TOKEN_MISSING), remote)


def test_up_log_choices_are_the_services_own():
    from services.common import logs
    from tessera.cli import main

    assert (main.LOG_FORMATS, main.LOG_LEVELS) == (logs.LOG_FORMATS, logs.LOG_LEVELS)


def test_messages_name_where_the_address_came_from(monkeypatch):
    remote = argparse.Namespace(address="nosuch.invalid:1", command="info")
    resolve = "errors resolving nosuch.invalid:1: [field:hostname lookup error:Domain name not found]"
    assert explain(Unavailable(resolve), remote) == f"the host in nosuch.invalid:1 (--address) does not resolve: {resolve}"
    monkeypatch.setenv("TESSERA_ADDRESS", "nosuch.invalid:1")
    assert explain(Unavailable(resolve), remote).startswith("the host in nosuch.invalid:1 ($TESSERA_ADDRESS) does")
    monkeypatch.setenv("TESSERA_ADDRESS", "gateway")
    with pytest.raises(ValueError, match=r"^\$TESSERA_ADDRESS 'gateway' needs host:port"):
        check_address("gateway")
    with pytest.raises(ValueError, match=r"^--address 'other' needs host:port"):
        check_address("other")
