"""`python -m services.gateway`: the public gRPC endpoint, and with `--http-port` its HTTP API."""

from __future__ import annotations

import argparse
import asyncio

from grpc_health.v1 import health as grpc_health

from services.common import auth, logs
from services.common.config_cli import add_flags, from_flags
from services.common.limits import GenerateLimits, PoolingLimits
from services.common.memory import unmap_large_buffers
from services.common.message_limits import gateway_bytes, pooling_bytes
from services.common.metrics import record_downstream, start_metrics_server
from services.common.server import exit_refused, serve
from services.gateway import metrics as gateway_metrics
from services.gateway.api_keys import ApiKeyInterceptor, read_api_keys
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.http import http_server
from services.gateway.http.backend import health_of
from services.gateway.servicer import GatewayServicer
from tessera.v1 import gateway_pb2, gateway_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    add_flags(parser, GatewayConfig)
    add_flags(parser, GenerateLimits)
    add_flags(parser, PoolingLimits)
    auth.add_arguments(parser, tls=True)
    logs.add_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return from_flags(GatewayConfig, args, limits=from_flags(GenerateLimits, args),
                          pooling_limits=from_flags(PoolingLimits, args))
    except ValueError as error:
        parser.error(str(error))


async def _main(config: GatewayConfig, security: auth.Security) -> None:
    record_downstream()  # before the core opens its channels
    core = GatewayCore(config)
    servicer = GatewayServicer(core)
    max_receive_bytes = max(gateway_bytes(config.limits.max_images),
                            pooling_bytes(config.pooling_limits.max_request_chars,
                                          config.pooling_limits.max_request_token_ids))
    try:
        keys = read_api_keys(config.api_key_file) if config.api_key_file else frozenset()
    except ValueError as error:
        raise SystemExit(str(error)) from None
    interceptors = [ApiKeyInterceptor(keys)] if keys else []
    health = grpc_health.aio.HealthServicer()  # the HTTP /health reads the gateway's own status from it
    http = (http_server(config, core, max_receive_bytes, gateway_health=health_of(health),
                        tls=(security.tls_cert_file, security.tls_key_file) if security.tls_cert_file else None,
                        extra_routes={"/metrics": gateway_metrics.asgi_app(core)})
            if config.http_port else None)

    async def start() -> None:
        await core.start()
        if http is not None:
            await http.start()

    async def stop() -> None:
        if http is not None:
            await http.stop()
        await core.close()

    start_metrics_server(config.metrics_port, config.address, *gateway_metrics.collectors(core))

    def register(server):
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        return [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name]

    # The public port: no internal-token check; the core's channels send the token.
    await serve("gateway", config.address, register, start=start, stop=stop, public=True, interceptors=interceptors,
                credentials=security.server_credentials(), max_receive_bytes=max_receive_bytes,
                health_servicer=health)


def main(argv: list[str] | None = None) -> None:
    logs.configure_logging("gateway", argv)  # first: the config logs its automatic choices
    config = parse_args(argv)
    unmap_large_buffers()  # the gateway relays messages and computes no tensors (memory.py)
    security = auth.configure_security(argv, tls=True)
    try:
        asyncio.run(_main(config, security))
    except (ValueError, OSError) as error:  # a configuration that cannot run here: one line, status 1
        exit_refused("gateway", error)


if __name__ == "__main__":
    main()
