"""`python -m services.pooling`: embeddings, rerank and tokenization over gRPC.

A configuration that cannot run exits with one line on stderr (services/common/run.py): status 2
for a bad value (--device cuda without CUDA, a bad number), as argparse does for a bad flag;
status 1 for what fails at start (a model that does not load, a warm-up forward that fails, a
port in use).
"""

from __future__ import annotations

import argparse

from services.common.auth import Security
from services.common.config_cli import from_flags
from services.common.message_limits import pooling_bytes
from services.common.metrics import MergedCollector, PoolingCollector, start_metrics_server
from services.common.run import parse_config, run_service, service_parser
from services.common.server import Listen, serve
from services.pooling.config import ModelFlags, PoolingConfig
from services.pooling.engine import PoolingEngine
from services.pooling.servicer import PoolingServicer
from tessera.v1 import pooling_pb2, pooling_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    return service_parser("pooling", __doc__, PoolingConfig, ModelFlags)


def configure(args: argparse.Namespace) -> PoolingConfig:
    return from_flags(PoolingConfig, args, models=from_flags(ModelFlags, args).models())


def parse_args(argv: list[str] | None = None) -> PoolingConfig:
    return parse_config(build_parser(), argv, configure)


async def serve_pooling(config: PoolingConfig, security: Security) -> None:
    engine = PoolingEngine(config)
    start_metrics_server(config.metrics_port, config.address, PoolingCollector(engine.queue_sizes),
                         MergedCollector(engine.batcher_stats))

    def register(server):
        pooling_pb2_grpc.add_PoolingServicer_to_server(PoolingServicer(engine), server)
        return [pooling_pb2.DESCRIPTOR.services_by_name["Pooling"].full_name]

    max_receive_bytes = pooling_bytes(config.max_request_chars, config.max_request_token_ids)
    await serve("pooling", Listen(config.address, max_receive_bytes), register, engine)


def main(argv: list[str] | None = None) -> None:
    run_service("pooling", argv, build_parser(), configure, serve_pooling)


if __name__ == "__main__":
    main()
