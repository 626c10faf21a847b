"""`python -m services.gateway`: the public gRPC endpoint, and with `--http-port` its HTTP API."""

from __future__ import annotations

import argparse
import asyncio

from services.common.auth import Security
from services.common.config_cli import from_flags
from services.common.health import HealthServicer
from services.common.limits import GenerateLimits, PoolingLimits
from services.common.memory import unmap_large_buffers
from services.common.message_limits import gateway_bytes, pooling_bytes
from services.common.metrics import record_downstream, start_metrics_server
from services.common.run import parse_config, run_service, service_parser
from services.common.server import Hooks, Listen, serve
from services.gateway import metrics as gateway_metrics
from services.gateway import readiness
from services.gateway.api_keys import ApiKeyInterceptor, read_api_keys
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.http import http_server
from services.gateway.http.backend import health_of
from services.gateway.servicer import GatewayServicer
from tessera.v1 import gateway_pb2, gateway_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    return service_parser("gateway", __doc__, GatewayConfig, GenerateLimits, PoolingLimits, tls=True)


def configure(args: argparse.Namespace) -> GatewayConfig:
    return from_flags(GatewayConfig, args, limits=from_flags(GenerateLimits, args),
                      pooling_limits=from_flags(PoolingLimits, args))


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    return parse_config(build_parser(), argv, configure)


async def serve_gateway(config: GatewayConfig, security: Security) -> None:
    unmap_large_buffers()  # the gateway relays messages and computes no tensors (memory.py)
    record_downstream()  # before the core opens its channels
    core = GatewayCore(config)
    servicer = GatewayServicer(core)
    max_receive_bytes = max(gateway_bytes(config.limits.max_images),
                            pooling_bytes(config.pooling_limits.max_request_chars,
                                          config.pooling_limits.max_request_token_ids))
    keys = read_api_keys(config.api_key_file) if config.api_key_file else frozenset()  # ValueError: exits 1
    health = HealthServicer()  # the HTTP /health reads the gateway's own status from it
    http = (http_server(config, core, max_receive_bytes, gateway_health=health_of(health),
                        tls=(security.tls_cert_file, security.tls_key_file) if security.tls_cert_file else None,
                        extra_routes={"/metrics": gateway_metrics.asgi_app(core)})
            if config.http_port else None)

    followers: list[asyncio.Task] = []

    async def start() -> None:
        await core.start()
        followers.append(asyncio.get_running_loop().create_task(readiness.follow(core, health)))
        if http is not None:
            await http.start()

    async def stop() -> None:
        for follower in followers:
            follower.cancel()
        if http is not None:
            await http.stop()
        await core.close()

    start_metrics_server(config.metrics_port, config.address, *gateway_metrics.collectors(core))

    def register(server):
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        return [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name]

    # The public port: no internal-token check; the core's channels send the token.
    listen = Listen(config.address, max_receive_bytes, interceptors=[ApiKeyInterceptor(keys)] if keys else [],
                    public=True, credentials=security.server_credentials())
    await readiness.register(health)  # the capability verdicts: NOT_SERVING until `follow` sets them
    await serve("gateway", listen, register, Hooks(start, stop), health_servicer=health)


def main(argv: list[str] | None = None) -> None:
    run_service("gateway", argv, build_parser(), configure, serve_gateway, tls=True)


if __name__ == "__main__":
    main()
