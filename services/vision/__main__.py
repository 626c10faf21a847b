"""`python -m services.vision`: images -> projected rows for the decoder.

Two encoders: `--encoder demo` (default; the seed's fixed-resolution tower with seeded RANDOM
weights -- plumbing, not answers) and `--encoder qwen2-vl --model-dir DIR` (a Qwen2-VL
checkpoint's vision tower + PatchMerger, with its preprocessing recipe and M-RoPE sections).
"""

from __future__ import annotations

import argparse
import asyncio

from services.common import auth
from services.common.message_limits import vision_bytes
from services.common.metrics import start_metrics_server
from services.common.liveness import DEFAULT_WEDGED_AFTER_S
from services.common.paths import default_decoder_dir
from services.common.server import configure_logging, serve
from services.vision.config import DEFAULT_ENCODER_CACHE_BYTES, DecoderGeometry, VisionConfig, parse_sections
from services.vision.encoder import DemoEncoderConfig
from services.vision.processor import ProcessorConfig, parse_color
from services.vision.qwen2_vl_encoder import Qwen2VLEncoderConfig
from services.vision.servicer import VisionServicer
from services.vision.stats import VisionCollector
from tessera.v1 import vision_pb2, vision_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    p, e = ProcessorConfig(), DemoEncoderConfig(output_width=1)
    parser = argparse.ArgumentParser(prog="python -m services.vision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=VisionConfig.address, help="bind host:port (default %(default)s)")
    parser.add_argument("--encoder", choices=("demo", "qwen2-vl"), default="demo", help="(default %(default)s)")
    parser.add_argument("--model-dir", default=None, help="Qwen2-VL checkpoint directory (--encoder qwen2-vl)")
    parser.add_argument("--min-pixels", type=int, default=None,
                        help="qwen2-vl: min H*W after resizing (default: the checkpoint's preprocessor config)")
    parser.add_argument("--max-pixels", type=int, default=None,
                        help="qwen2-vl: max H*W after resizing (default: the checkpoint's preprocessor config)")
    parser.add_argument("--encoder-cache-bytes", type=int, default=DEFAULT_ENCODER_CACHE_BYTES,
                        help="encoder-output cache size in bytes, 0 disables (default %(default)s)")
    parser.add_argument("--output-width", type=int, default=None,
                        help="demo: rows' width; must equal the decoder's hidden_size "
                             "(default: from --decoder-model-dir)")
    parser.add_argument("--decoder-model-dir", default=None,
                        help=f"decoder checkpoint whose config.json gives hidden_size and head_dim (demo default "
                             f"{default_decoder_dir()} when --output-width is not given; qwen2-vl default --model-dir)")
    parser.add_argument("--seed", type=int, default=e.seed, help="demo encoder weight seed (default %(default)s)")
    parser.add_argument("--image-size", type=int, default=p.image_size,
                        help="demo resize side in pixels (default %(default)s)")
    parser.add_argument("--patch-size", type=int, default=e.patch_size,
                        help="demo patch side in pixels (default %(default)s)")
    parser.add_argument("--max-image-bytes", type=int, default=p.max_image_bytes,
                        help="compressed bytes per image (default %(default)s)")
    parser.add_argument("--max-image-pixels", type=int, default=p.max_image_pixels,
                        help="width*height per image, checked from the header (default %(default)s)")
    parser.add_argument("--max-images", type=int, default=p.max_images, help="images per request (default %(default)s)")
    parser.add_argument("--max-request-pixels", type=int, default=p.max_request_pixels,
                        help="width*height over a request's images to decode, from the headers (default %(default)s)")
    parser.add_argument("--mrope-section", default=None,
                        help="demo: rotary pairs per (t,h,w) axis, e.g. 8,12,12 (default "
                             f"{','.join(map(str, VisionConfig.mrope_section))}); qwen2-vl: from the checkpoint")
    parser.add_argument("--wedged-after-s", type=float, default=DEFAULT_WEDGED_AFTER_S,
                        help="health turns NOT_SERVING when images wait and no encode completes for this long "
                             "(seconds; must exceed the longest encode; default %(default)s)")
    parser.add_argument("--background", default="white",
                        help="colour under transparent pixels: name, #RRGGBB or R,G,B (default %(default)s)")
    auth.add_arguments(parser)
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics on this port, same host as --address (default 0: off)")
    return parser


def parse_args(argv: list[str] | None = None) -> VisionConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args)
    except ValueError as error:
        parser.error(str(error))


def config_from_args(args: argparse.Namespace) -> VisionConfig:
    """Raises ValueError for any inconsistent flag (e.g. output width != decoder hidden size)."""
    processor = ProcessorConfig(image_size=args.image_size, max_image_bytes=args.max_image_bytes,
                                max_image_pixels=args.max_image_pixels, max_images=args.max_images,
                                max_request_pixels=args.max_request_pixels,
                                background=parse_color(args.background))
    if args.encoder == "qwen2-vl":
        return _qwen2_vl_config(args, processor)
    model_dir = args.decoder_model_dir
    if model_dir is None and args.output_width is None:
        model_dir = default_decoder_dir()
    decoder = DecoderGeometry.from_model_dir(model_dir) if model_dir is not None else None
    output_width = args.output_width if args.output_width is not None else decoder.hidden_size
    encoder = DemoEncoderConfig(output_width=output_width, image_size=args.image_size,
                                patch_size=args.patch_size, seed=args.seed)
    sections = parse_sections(args.mrope_section or ",".join(map(str, VisionConfig.mrope_section)))
    return VisionConfig(encoder=encoder, processor=processor, address=args.address, mrope_section=sections,
                        decoder=decoder, encoder_cache_bytes=args.encoder_cache_bytes,
                        wedged_after_s=args.wedged_after_s, metrics_port=args.metrics_port)


def _qwen2_vl_config(args: argparse.Namespace, processor: ProcessorConfig) -> VisionConfig:
    if args.model_dir is None:
        raise ValueError("--encoder qwen2-vl needs --model-dir (a Qwen2-VL checkpoint directory)")
    if args.output_width is not None:
        raise ValueError("--output-width applies to the demo encoder; Qwen2-VL's comes from its vision_config")
    encoder = Qwen2VLEncoderConfig(model_dir=args.model_dir, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    decoder = DecoderGeometry.from_model_dir(args.decoder_model_dir or args.model_dir)
    config = VisionConfig.for_qwen2_vl(encoder, processor, address=args.address, decoder=decoder,
                                       encoder_cache_bytes=args.encoder_cache_bytes,
                                       wedged_after_s=args.wedged_after_s, metrics_port=args.metrics_port)
    if args.mrope_section is not None and parse_sections(args.mrope_section) != config.mrope_section:
        raise ValueError(f"--mrope-section {args.mrope_section} differs from the checkpoint's {config.mrope_section}")
    return config


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
    configure_logging()
    config = parse_args(argv)
    auth.configure_security(argv)
    asyncio.run(_main(config))


if __name__ == "__main__":
    main()
