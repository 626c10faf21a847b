"""`python -m services.pooling`: embeddings, rerank and tokenization over gRPC.

A configuration that cannot run (a bad value, --device cuda without CUDA, a model that does not
load, a warm-up forward that fails, a port in use) exits with status 1 and one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio

from services.common import auth, logs
from services.common.config_cli import add_flags, from_flags
from services.common.message_limits import pooling_bytes
from services.common.metrics import MergedCollector, PoolingCollector, start_metrics_server
from services.common.server import exit_refused, exit_unhealthy_after_s, serve
from services.pooling.config import ModelFlags, PoolingConfig
from services.pooling.engine import PoolingEngine
from services.pooling.servicer import PoolingServicer
from tessera.v1 import pooling_pb2, pooling_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.pooling", description=__doc__)
    add_flags(parser, PoolingConfig)
    add_flags(parser, ModelFlags)
    auth.add_arguments(parser)
    logs.add_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> PoolingConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return from_flags(PoolingConfig, args, models=from_flags(ModelFlags, args).models())
    except ValueError as error:
        exit_refused("pooling", error)


async def _main(config: PoolingConfig) -> None:
    engine = PoolingEngine(config)
    start_metrics_server(config.metrics_port, config.address, PoolingCollector(engine.queue_sizes),
                         MergedCollector(engine.batcher_stats))

    def register(server):
        pooling_pb2_grpc.add_PoolingServicer_to_server(PoolingServicer(engine), server)
        return [pooling_pb2.DESCRIPTOR.services_by_name["Pooling"].full_name]

    async def start() -> None:
        await engine.compute.run(engine.load)  # weights touched first by the compute thread

    await serve("pooling", config.address, register, start=start, health=engine.health,
                max_receive_bytes=pooling_bytes(config.max_request_chars, config.max_request_token_ids))


def main(argv: list[str] | None = None) -> None:
    logs.configure_logging("pooling", argv)  # first: the config logs its automatic choices
    config = parse_args(argv)
    auth.configure_security(argv)
    try:
        exit_unhealthy_after_s()  # checked before the models load (serve reads it again)
        asyncio.run(_main(config))
    except (ValueError, OSError) as error:
        exit_refused("pooling", error)


if __name__ == "__main__":
    main()
