"""`python -m services.vision`: images -> projected rows for the decoder.

Two encoders: `--encoder demo` (default; a fixed-resolution tower with seeded RANDOM
weights -- plumbing, not answers) and `--encoder qwen2-vl --model-dir DIR` (a Qwen2-VL or
Qwen2.5-VL checkpoint's vision tower + PatchMerger, with its preprocessing recipe and M-RoPE sections).
"""

from __future__ import annotations

import argparse

from services.common.auth import Security
from services.common.config_cli import from_flags
from services.common.message_limits import vision_bytes
from services.common.metrics import start_metrics_server
from services.common.run import parse_config, run_service, service_parser
from services.common.server import Listen, serve
from services.vision.config import VisionConfig, VisionFlags
from services.vision.engine import VisionEngine
from services.vision.servicer import VisionServicer
from services.vision.stats import VisionCollector
from tessera.v1 import vision_pb2, vision_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    return service_parser("vision", __doc__, VisionFlags, raw_description=True)


def configure(args: argparse.Namespace) -> VisionConfig:
    return from_flags(VisionFlags, args).vision_config()


def parse_args(argv: list[str] | None = None) -> VisionConfig:
    return parse_config(build_parser(), argv, configure)


async def serve_vision(config: VisionConfig, security: Security) -> None:
    engine = VisionEngine(config)
    start_metrics_server(config.metrics_port, config.address, VisionCollector(lambda: engine.core))

    def register(server):
        vision_pb2_grpc.add_VisionServicer_to_server(VisionServicer(engine), server)
        return [vision_pb2.DESCRIPTOR.services_by_name["Vision"].full_name]

    processor = config.processor
    await serve("vision", Listen(config.address, vision_bytes(processor.max_images, processor.max_image_bytes)),
                register, engine)


def main(argv: list[str] | None = None) -> None:
    run_service("vision", argv, build_parser(), configure, serve_vision)


if __name__ == "__main__":
    main()
