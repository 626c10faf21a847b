"""`run_service`: the one skeleton of every `python -m services.<name>`: parse -> configure -> serve.

One exit-code rule for every service, as argparse has for a bad flag:

- status 2, one line on stderr ("python -m services.NAME: error: ..."): a bad flag (argparse's own
  message, after its usage line) or a value the config check refuses (a ValueError from the
  config dataclass: a bad number, a directory that is not the right checkpoint, --device cuda
  without CUDA, a bad $TESSERA_EXIT_UNHEALTHY_AFTER_S), before anything loads or listens;
- status 1, one line "NAME: cause" (`server.exit_refused`): a failure at start (weights that do not
  load, a warm-up step that fails, a port in use, a token or key file that cannot be read);
- status 3 (`server.EXIT_UNHEALTHY`): gave up after NOT_SERVING for $TESSERA_EXIT_UNHEALTHY_AFTER_S.

Health never says SERVING for a service that exits 1 or 2.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn, TypeVar

from services.common import auth, logs
from services.common.config_cli import add_flags
from services.common.server import exit_refused, exit_unhealthy_after_s

C = TypeVar("C")


def service_parser(name: str, description: str | None, *configs: type, tls: bool = False,
                   raw_description: bool = False) -> argparse.ArgumentParser:
    """`python -m services.NAME`'s parser: one flag per field of each config dataclass
    (config_cli.py), then the security and logging flags every service has."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}", description=description,
                                     formatter_class=(argparse.RawDescriptionHelpFormatter if raw_description
                                                      else argparse.HelpFormatter))
    for config in configs:
        add_flags(parser, config)
    auth.add_arguments(parser, tls=tls)
    logs.add_arguments(parser)
    return parser


def refuse_value(parser: argparse.ArgumentParser, error: ValueError) -> NoReturn:
    """Exit 2 with one line naming the refused value, as argparse does for a bad flag (without its usage)."""
    parser.exit(2, f"{parser.prog}: error: {' '.join(str(error).split())}\n")


def parse_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                 configure: Callable[[argparse.Namespace], C]) -> C:
    """The config `configure` builds from the parsed flags; exits 2 (`refuse_value`) for a value it
    refuses with ValueError, argparse's own 2 for a bad flag."""
    args = parser.parse_args(argv)
    try:
        return configure(args)
    except ValueError as error:
        refuse_value(parser, error)


def run_service(name: str, argv: Sequence[str] | None, parser: argparse.ArgumentParser,
                configure: Callable[[argparse.Namespace], C],
                serve_config: Callable[[C, auth.Security], Awaitable[None]], tls: bool = False) -> None:
    """Parse `argv` (default sys.argv[1:]) with `parser`, build the config with `configure`, read
    the security settings, then run `serve_config(config, security)` (which calls `serve`) until
    SIGTERM; exits by the module's rule.

    Logging is configured first: the config logs its automatic choices.
    """
    logs.configure_logging(name, argv)
    config = parse_config(parser, argv, configure)
    try:
        exit_unhealthy_after_s()  # a bad value is refused before anything loads (serve reads it again)
    except ValueError as error:
        refuse_value(parser, error)
    security = auth.configure_security(argv, tls=tls)
    try:
        asyncio.run(serve_config(config, security))
    except (ValueError, OSError) as error:  # a configuration that cannot run here: one line, status 1
        exit_refused(name, error)
