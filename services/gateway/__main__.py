"""`python -m services.gateway`: the public gRPC endpoint, and with `--http-port` its HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import os

from services.common import auth
from services.common.memory import unmap_large_buffers
from services.common.message_limits import gateway_bytes, pooling_bytes
from services.common.limits import GenerateLimits, PoolingLimits, add_flags, flag, from_flags
from services.common.server import configure_logging, serve
from services.gateway.config import GatewayConfig
from services.gateway.http import http_server
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
    for name in ("http_port", "api_key_file"):  # the config's own help and environment variable
        meta = GatewayConfig.__dataclass_fields__[name].metadata
        default = os.environ.get(meta["env"], getattr(d, name))
        parser.add_argument(flag(name), type=type(getattr(d, name)), default=default,
                            help=f"{meta['help']} (default ${meta['env']} or %(default)r)")
    auth.add_arguments(parser, tls=True)
    args = parser.parse_args(argv)
    return GatewayConfig(address=args.address, decoder=args.decoder, pooling=args.pooling, adapters=args.adapters,
                         vision=args.vision, limits=from_flags(GenerateLimits, args),
                         pooling_limits=from_flags(PoolingLimits, args), max_path_chars=args.max_path_chars,
                         http_port=int(args.http_port), api_key_file=args.api_key_file)


async def _main(config: GatewayConfig, security: auth.Security) -> None:
    servicer = GatewayServicer(config)
    max_receive_bytes = max(gateway_bytes(config.limits.max_images),
                            pooling_bytes(config.pooling_limits.max_request_chars,
                                          config.pooling_limits.max_request_token_ids))
    try:
        http = http_server(config, max_receive_bytes, security.tls_cert_file) if config.http_port else None
    except ValueError as error:
        raise SystemExit(str(error)) from None

    async def start() -> None:
        await servicer.start()
        if http is not None:
            await http.start()

    async def stop() -> None:
        if http is not None:
            await http.stop()
        await servicer.close()

    def register(server):
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        return [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name]

    # The public port: no internal-token check; the servicer's channels send the token.
    await serve("gateway", config.address, register, start=start, stop=stop, public=True,
                credentials=security.server_credentials(), max_receive_bytes=max_receive_bytes)


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    config = parse_args(argv)
    unmap_large_buffers()  # the gateway relays messages and computes no tensors (memory.py)
    asyncio.run(_main(config, auth.configure_security(argv, tls=True)))


if __name__ == "__main__":
    main()
