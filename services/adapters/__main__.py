"""`python -m services.adapters`: the adapter registry over gRPC."""

from __future__ import annotations

import argparse
import asyncio

from services.adapters.auth import AdminAuthInterceptor
from services.adapters.config import RegistryConfig
from services.adapters.engine import AdapterRegistry
from services.adapters.servicer import register
from services.common import auth, logs
from services.common.config_cli import add_flags, from_flags
from services.common.message_limits import REGISTRY_BYTES
from services.common.metrics import start_metrics_server
from services.common.server import exit_refused, serve
from tessera.protocol import ADMIN_TOKEN_ENV


class RefuseSecretInArgv(argparse.Action):
    """`--admin-token VALUE`, refused without echoing the value: argv is world-readable in `ps`."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} would show the token to every local user (ps); "
                     f"use --admin-token-file PATH or ${ADMIN_TOKEN_ENV}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.adapters", description=__doc__)
    add_flags(parser, RegistryConfig)
    parser.add_argument("--admin-token", action=RefuseSecretInArgv, help=argparse.SUPPRESS)
    auth.add_arguments(parser)
    logs.add_arguments(parser)
    return parser


def parse_config(argv: list[str] | None = None) -> tuple[str, RegistryConfig]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = from_flags(RegistryConfig, args)
    except ValueError as error:
        parser.error(str(error))
    return config.address, config


def main(argv: list[str] | None = None) -> None:
    logs.configure_logging("adapters", argv)  # first: the config logs its automatic choices
    address, config = parse_config(argv)
    auth.configure_security(argv)
    registry = AdapterRegistry(config)
    start_metrics_server(config.metrics_port, address)

    async def stop() -> None:
        registry.close()

    try:
        asyncio.run(serve("adapters", address, lambda server: register(server, registry), stop=stop,
                          interceptors=[AdminAuthInterceptor(config.admin_token)], max_receive_bytes=REGISTRY_BYTES))
    except (ValueError, OSError) as error:  # a configuration that cannot run here: one line, status 1
        exit_refused("adapters", error)


if __name__ == "__main__":
    main()
