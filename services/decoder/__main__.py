"""python -m services.decoder --address HOST:PORT [flags]

A configuration that cannot run exits with one line on stderr naming the flag and why, and
health never says SERVING: status 2 for what the config check refuses (a bad value, a directory
that is not a decoder checkpoint, --device cuda without CUDA, a Triton backend without a GPU), as
argparse does for a bad flag; status 1 for what fails later (weights that do not load, a warm-up
step that fails, a port in use).
"""

from __future__ import annotations

import argparse
import asyncio

from services.common import auth, logs
from services.common.config_cli import add_flags, from_flags
from services.common.limits import GenerateLimits
from services.common.message_limits import decoder_bytes
from services.common.metrics import start_metrics_server
from services.common.server import exit_refused, exit_unhealthy_after_s, serve
from services.decoder.adapter_client import RegistryAdapterSource
from services.decoder.config import DecoderConfig
from services.decoder.engine import LLMEngine
from services.decoder.servicer import DecoderServicer
from tessera.v1 import decoder_pb2, decoder_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.decoder", description=__doc__)
    add_flags(parser, DecoderConfig)
    add_flags(parser, GenerateLimits)
    auth.add_arguments(parser)
    logs.add_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[str, DecoderConfig]:
    """The bind address and config; a configuration that cannot start (a directory that is not a
    decoder checkpoint, a bad value) exits 2 with one line on stderr, as argparse does for a bad flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = from_flags(DecoderConfig, args, limits=from_flags(GenerateLimits, args))
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return config.address, config


def main(argv: list[str] | None = None) -> None:
    logs.configure_logging("decoder", argv)  # first: the config logs its automatic choices
    address, config = parse_args(argv)
    auth.configure_security(argv)
    try:
        exit_unhealthy_after_s()  # checked before the model loads (serve reads it again)
        run(address, config)
    except (ValueError, OSError) as error:  # a configuration that cannot run here: one line, status 1
        exit_refused("decoder", error)


def run(address: str, config: DecoderConfig) -> None:
    """Serve until SIGTERM. Raises ValueError (the model or a warm-up step through the configured
    backends failed) or OSError (a port cannot be bound) before health ever says SERVING."""
    engine = LLMEngine(config, RegistryAdapterSource.from_config(config))
    servicer = DecoderServicer(engine)
    start_metrics_server(config.metrics_port, address, engine.collector())

    def register(server):
        decoder_pb2_grpc.add_DecoderServicer_to_server(servicer, server)
        return [decoder_pb2.DESCRIPTOR.services_by_name["Decoder"].full_name]

    hidden_size = config.checkpoint.hidden_size
    asyncio.run(serve("decoder", address, register, start=engine.start, stop=engine.stop,
                      health=engine.health, max_receive_bytes=decoder_bytes(config.max_model_len, hidden_size)))


if __name__ == "__main__":
    main()
