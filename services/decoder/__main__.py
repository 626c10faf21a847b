"""python -m services.decoder --address HOST:PORT [flags]

A configuration that cannot run exits with one line on stderr naming the flag and why, and
health never says SERVING (services/common/run.py): status 2 for what the config check refuses (a
bad value, a directory that is not a decoder checkpoint, --device cuda without CUDA, a Triton
backend without a GPU), as argparse does for a bad flag; status 1 for what fails later (weights
that do not load, a warm-up step that fails, a port in use).
"""

from __future__ import annotations

import argparse

from services.common.auth import Security
from services.common.config_cli import from_flags
from services.common.limits import GenerateLimits
from services.common.message_limits import decoder_bytes
from services.common.metrics import start_metrics_server
from services.common.run import parse_config, run_service, service_parser
from services.common.server import Listen, serve
from services.decoder.adapter_client import RegistryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine import LLMEngine
from services.decoder.servicer import DecoderServicer
from tessera.v1 import decoder_pb2, decoder_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    return service_parser("decoder", __doc__, DecoderConfig, GenerateLimits)


def configure(args: argparse.Namespace) -> DecoderConfig:
    return from_flags(DecoderConfig, args, limits=from_flags(GenerateLimits, args))


def parse_args(argv: list[str] | None = None) -> DecoderConfig:
    """The config; a configuration that cannot start (a directory that is not a decoder checkpoint,
    a bad value) exits 2 with one line on stderr, as argparse does for a bad flag."""
    return parse_config(build_parser(), argv, configure)


async def serve_decoder(config: DecoderConfig, security: Security) -> None:
    """Serve until SIGTERM. Raises ValueError (the model or a warm-up step through the configured
    backends failed) or OSError (a port cannot be bound) before health ever says SERVING."""
    engine = LLMEngine(config, RegistryAdapterSource.from_config(config), prestart_grammar_workers=True)
    servicer = DecoderServicer(engine)
    start_metrics_server(config.metrics_port, config.address, engine.collector())

    def register(server):
        decoder_pb2_grpc.add_DecoderServicer_to_server(servicer, server)
        return [decoder_pb2.DESCRIPTOR.services_by_name["Decoder"].full_name]

    max_receive_bytes = decoder_bytes(config.max_model_len, config.checkpoint.hidden_size)
    await serve("decoder", Listen(config.address, max_receive_bytes), register, engine)


def main(argv: list[str] | None = None) -> None:
    run_service("decoder", argv, build_parser(), configure, serve_decoder)


if __name__ == "__main__":
    main()
