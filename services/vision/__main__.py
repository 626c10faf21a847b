"""`python -m services.vision`: images -> projected rows for the decoder.

Two encoders: `--encoder demo` (default; a fixed-resolution tower with seeded RANDOM
weights -- plumbing, not answers) and `--encoder qwen2-vl --model-dir DIR` (a Qwen2-VL
checkpoint's vision tower + PatchMerger, with its preprocessing recipe and M-RoPE sections).
"""

from __future__ import annotations

import argparse
import asyncio

from services.common import auth, logs
from services.common.config_cli import add_flags, from_flags
from services.common.message_limits import vision_bytes
from services.common.metrics import start_metrics_server
from services.common.server import exit_refused, serve
from services.vision.config import VisionConfig, VisionFlags
from services.vision.servicer import VisionServicer
from services.vision.stats import VisionCollector
from tessera.v1 import vision_pb2, vision_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.vision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, VisionFlags)
    auth.add_arguments(parser)
    logs.add_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> VisionConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return from_flags(VisionFlags, args).vision_config()
    except ValueError as error:
        parser.error(str(error))


async def _main(config: VisionConfig) -> None:
    servicer = VisionServicer(config)
    start_metrics_server(config.metrics_port, config.address, VisionCollector(lambda: servicer._engine))

    def register(server):
        vision_pb2_grpc.add_VisionServicer_to_server(servicer, server)
        return [vision_pb2.DESCRIPTOR.services_by_name["Vision"].full_name]

    processor = config.processor
    await serve("vision", config.address, register, start=servicer.start, health=servicer.health,
                max_receive_bytes=vision_bytes(processor.max_images, processor.max_image_bytes))


def main(argv: list[str] | None = None) -> None:
    logs.configure_logging("vision", argv)  # first: the config logs its automatic choices
    config = parse_args(argv)
    auth.configure_security(argv)
    try:
        asyncio.run(_main(config))
    except (ValueError, OSError) as error:  # a configuration that cannot run here: one line, status 1
        exit_refused("vision", error)


if __name__ == "__main__":
    main()
