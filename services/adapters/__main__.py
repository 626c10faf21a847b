"""`python -m services.adapters --address HOST:PORT [--root DIR] [--db FILE] [--admin-token T]
[--base-model-dir DIR] [--max-rank N]`: run the adapter registry."""

from __future__ import annotations

import argparse
import asyncio

from services.adapters.auth import AdminAuthInterceptor
from services.adapters.config import ADMIN_TOKEN_ENV, RegistryConfig
from services.adapters.servicer import register
from services.adapters.service import RegistryService
from services.common import auth
from services.common.message_limits import REGISTRY_BYTES
from services.common.metrics import start_metrics_server
from services.common.limits import flag
from services.common.paths import default_adapter_root
from services.common.server import DEFAULT_PORTS, configure_logging, serve


def parse_config(argv: list[str] | None = None) -> tuple[str, RegistryConfig]:
    parser = argparse.ArgumentParser(prog="python -m services.adapters", description="tessera adapter registry")
    parser.add_argument("--address", default=f"127.0.0.1:{DEFAULT_PORTS['adapters']}")
    parser.add_argument("--root", default=None, help=f"adapter root (default {default_adapter_root()})")
    parser.add_argument("--db", default=None, help="SQLite catalog (default <root>/registry.sqlite3)")
    parser.add_argument("--admin-token", default=None,
                        help=f"bearer token for Load/Unload (default ${ADMIN_TOKEN_ENV}; empty = no auth)")
    parser.add_argument("--base-model-dir", default=None, help="validate targets against this model's config.json")
    parser.add_argument("--max-rank", type=int, default=64)
    auth.add_arguments(parser)
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics on this port, same host as --address (default 0: off)")
    defaults = RegistryConfig.__dataclass_fields__
    for name, help_text in (("max_path_chars", "characters of LoadAdapter's path"),
                            ("max_name_chars", "characters of a name, digest or decoder id"),
                            ("max_report_entries", "entries of each list of a ResidencyReport")):
        parser.add_argument(flag(name), type=int, default=defaults[name].default,
                            help=f"{help_text} (default %(default)s)")
    args = parser.parse_args(argv)
    kwargs = {"db_path": args.db, "admin_token": args.admin_token, "base_model_dir": args.base_model_dir,
              "max_rank": args.max_rank, "max_path_chars": args.max_path_chars,
              "max_name_chars": args.max_name_chars, "max_report_entries": args.max_report_entries,
              "metrics_port": args.metrics_port}
    if args.root:
        kwargs["root"] = args.root
    try:
        return args.address, RegistryConfig(**kwargs)
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> None:
    address, config = parse_config(argv)
    auth.configure_security(argv)
    configure_logging()
    registry = RegistryService(config)
    start_metrics_server(config.metrics_port, address)

    async def stop() -> None:
        registry.close()

    asyncio.run(serve("adapters", address, lambda server: register(server, registry), stop=stop,
                      interceptors=[AdminAuthInterceptor(config.admin_token)], max_receive_bytes=REGISTRY_BYTES))


if __name__ == "__main__":
    main()
