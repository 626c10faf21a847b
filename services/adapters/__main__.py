"""`python -m services.adapters`: the adapter registry over gRPC."""

from __future__ import annotations

import argparse

from services.adapters.auth import AdminAuthInterceptor
from services.adapters.config import RegistryConfig
from services.adapters.engine import AdapterRegistry
from services.adapters.servicer import register
from services.common.auth import Security
from services.common.config_cli import from_flags
from services.common.message_limits import REGISTRY_BYTES
from services.common.metrics import start_metrics_server
from services.common.run import parse_config, run_service, service_parser
from services.common.server import Hooks, Listen, serve
from tessera.protocol import ADMIN_TOKEN_ENV


class RefuseSecretInArgv(argparse.Action):
    """`--admin-token VALUE`, refused without echoing the value: argv is world-readable in `ps`."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} would show the token to every local user (ps); "
                     f"use --admin-token-file PATH or ${ADMIN_TOKEN_ENV}")


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser("adapters", __doc__, RegistryConfig)
    parser.add_argument("--admin-token", action=RefuseSecretInArgv, help=argparse.SUPPRESS)
    return parser


def configure(args: argparse.Namespace) -> RegistryConfig:
    return from_flags(RegistryConfig, args)


def parse_args(argv: list[str] | None = None) -> RegistryConfig:
    return parse_config(build_parser(), argv, configure)


async def serve_registry(config: RegistryConfig, security: Security) -> None:
    registry = AdapterRegistry(config)
    start_metrics_server(config.metrics_port, config.address)

    async def stop() -> None:
        registry.close()

    listen = Listen(config.address, REGISTRY_BYTES, interceptors=[AdminAuthInterceptor(config.admin_token)])
    await serve("adapters", listen, lambda server: register(server, registry), Hooks(stop=stop))


def main(argv: list[str] | None = None) -> None:
    run_service("adapters", argv, build_parser(), configure, serve_registry)


if __name__ == "__main__":
    main()
