"""`python -m services.gateway`: the public gRPC endpoint."""

from __future__ import annotations

import argparse
import asyncio

from services.common import auth
from services.common.memory import unmap_large_buffers
from services.common.message_limits import gateway_bytes, pooling_bytes
from services.common.metrics import record_downstream, start_metrics_server
from services.common.limits import GenerateLimits, PoolingLimits, add_flags, from_flags
from services.common.server import configure_logging, serve
from services.gateway import metrics as gateway_metrics
from services.gateway.config import GatewayConfig
from services.gateway.servicer import GatewayServicer
from tessera.v1 import gateway_pb2, gateway_pb2_grpc


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    d = GatewayConfig()
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    parser.add_argument("--address", default=d.address, help="bind host:port (default %(default)s)")
    parser.add_argument("--decoder", default=d.decoder,
                        help="decoder replicas: host:port, ipv4:a:p,b:p or dns:///name:port")
    parser.add_argument("--pooling", default=d.pooling,
                        help="pooling replicas: host:port, ipv4:a:p,b:p or dns:///name:port")
    parser.add_argument("--adapters", default=d.adapters, help="adapter registry host:port")
    parser.add_argument("--vision", default=d.vision, help="vision host:port; empty string = no vision (images refused)")
    parser.add_argument("--max-path-chars", type=int, default=d.max_path_chars,
                        help="characters of LoadAdapter's path (default %(default)s)")
    add_flags(parser, GenerateLimits)
    add_flags(parser, PoolingLimits)
    auth.add_arguments(parser, tls=True)
    parser.add_argument("--metrics-port", type=int, default=d.metrics_port,
                        help="also serve Prometheus /metrics on this port, same host as --address (default 0: off)")
    args = parser.parse_args(argv)
    return GatewayConfig(address=args.address, decoder=args.decoder, pooling=args.pooling, adapters=args.adapters,
                         vision=args.vision, limits=from_flags(GenerateLimits, args),
                         pooling_limits=from_flags(PoolingLimits, args), max_path_chars=args.max_path_chars,
                         metrics_port=args.metrics_port)


async def _main(config: GatewayConfig, security: auth.Security) -> None:
    record_downstream()  # before the servicer opens its channels
    servicer = GatewayServicer(config)
    start_metrics_server(config.metrics_port, config.address, *gateway_metrics.collectors(servicer))

    def register(server):
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        return [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name]

    # The public port: no internal-token check; the servicer's channels send the token.
    await serve("gateway", config.address, register, start=servicer.start, stop=servicer.close, public=True,
                credentials=security.server_credentials(),
                max_receive_bytes=max(gateway_bytes(config.limits.max_images),
                                      pooling_bytes(config.pooling_limits.max_request_chars,
                                                    config.pooling_limits.max_request_token_ids)))


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    config = parse_args(argv)
    unmap_large_buffers()  # the gateway relays messages and computes no tensors (memory.py)
    asyncio.run(_main(config, auth.configure_security(argv, tls=True)))


if __name__ == "__main__":
    main()
