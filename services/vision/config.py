"""Vision service configuration: where it listens, the preprocessing recipe, the encoder, M-RoPE sections."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from services.common.liveness import DEFAULT_WEDGED_AFTER_S, check_wedged_after_s
from services.common.metrics import check_metrics_port
from services.common.mrope import (
    DEFAULT_MROPE_SECTION,
    check_checkpoint_section,
    check_mrope_section,
    parse_mrope_section,
)
from services.common.server import default_address
from services.vision.encoder import DemoEncoderConfig, decoder_geometry
from services.vision.processor import ProcessorConfig, parse_color
from services.vision.qwen2_vl_encoder import Qwen2VLEncoderConfig, read_checkpoint
from tessera.paths import default_decoder_dir
from tessera.protocol import METRICS_PORT_ENV

DEFAULT_ENCODER_CACHE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class DecoderGeometry:
    """What the vision service must match in the decoder: its hidden size and rotary head_dim."""

    hidden_size: int
    head_dim: int

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> DecoderGeometry:
        hidden, head_dim = decoder_geometry(model_dir)
        return cls(hidden_size=hidden, head_dim=head_dim)


@dataclass(frozen=True)
class VisionConfig:
    """Validated once. `decoder` (optional) is checked against output width and M-RoPE sections.

    With a Qwen2-VL encoder, the processor must carry the checkpoint's recipe
    (`ProcessorConfig.qwen2_vl`) and `mrope_section` must be the checkpoint's; use
    `VisionConfig.for_qwen2_vl` to get both from the directory.
    """

    encoder: DemoEncoderConfig | Qwen2VLEncoderConfig
    processor: ProcessorConfig = field(default_factory=ProcessorConfig)
    address: str = default_address("vision")
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION
    decoder: DecoderGeometry | None = None
    encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES  # 0 disables the encoder cache
    wedged_after_s: float = DEFAULT_WEDGED_AFTER_S  # encodes waiting, none completed this long -> NOT_SERVING
    metrics_port: int = 0  # Prometheus /metrics on this port, same host as `address`; 0: off

    @classmethod
    def for_qwen2_vl(cls, encoder: Qwen2VLEncoderConfig, processor: ProcessorConfig | None = None,
                     **kwargs) -> VisionConfig:
        """Recipe and M-RoPE sections from the checkpoint; `processor` supplies the caps and background."""
        checkpoint = read_checkpoint(encoder)
        processor = replace(processor or ProcessorConfig(), qwen2_vl=checkpoint.pixels)
        return cls(encoder=encoder, processor=processor, mrope_section=checkpoint.mrope_section, **kwargs)

    def __post_init__(self) -> None:
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"address must be host:port with a port in 1..65535, got {self.address!r}")
        check_wedged_after_s(self.wedged_after_s)
        check_metrics_port(self.metrics_port)
        if self.encoder_cache_bytes < 0:
            raise ValueError(f"encoder_cache_bytes must be >= 0, got {self.encoder_cache_bytes}")
        check_mrope_section(self.mrope_section, minimum=1)
        output_width = self._check_encoder()
        if self.decoder is None:
            return
        if output_width != self.decoder.hidden_size:
            raise ValueError(f"output_width {output_width} must equal the decoder's hidden_size "
                             f"{self.decoder.hidden_size}")
        check_mrope_section(self.mrope_section, self.decoder.head_dim, minimum=1)

    def _check_encoder(self) -> int:
        """Processor/encoder agreement; returns the encoder's output width."""
        if isinstance(self.encoder, DemoEncoderConfig):
            if self.processor.qwen2_vl is not None:
                raise ValueError("the demo encoder takes fixed-size pixels; processor.qwen2_vl must be None")
            if self.processor.image_size != self.encoder.image_size:
                raise ValueError(f"processor image_size {self.processor.image_size} must equal the encoder's "
                                 f"{self.encoder.image_size}")
            return self.encoder.output_width
        checkpoint = read_checkpoint(self.encoder)
        if self.processor.qwen2_vl != checkpoint.pixels:
            raise ValueError(f"processor.qwen2_vl {self.processor.qwen2_vl} must be the checkpoint's recipe "
                             f"{checkpoint.pixels}")
        check_checkpoint_section(self.mrope_section, checkpoint.mrope_section)
        return checkpoint.vision.output_width


_PROCESSOR, _DEMO = ProcessorConfig(), DemoEncoderConfig(output_width=1)


def _flag(default, help_text: str, **metadata):
    return field(default=default, metadata={"help": help_text, **metadata})


@dataclass
class VisionFlags:
    """The command line of `python -m services.vision`; `vision_config()` builds the `VisionConfig`.

    Two encoders: "demo" (a fixed-resolution tower with seeded random weights) and "qwen2-vl"
    (a Qwen2-VL or Qwen2.5-VL checkpoint's vision tower, its preprocessing recipe and M-RoPE sections).
    """

    address: str = _flag(default_address("vision"), "bind host:port")
    encoder: str = _flag("demo", "image encoder", choices=("demo", "qwen2-vl"))
    model_dir: str | None = _flag(None, "Qwen2-VL or Qwen2.5-VL checkpoint directory (--encoder qwen2-vl)")
    min_pixels: int | None = _flag(None, "qwen2-vl: min H*W after resizing",
                                   default_help="the checkpoint's preprocessor config")
    max_pixels: int | None = _flag(None, "qwen2-vl: max H*W after resizing",
                                   default_help="the checkpoint's preprocessor config")
    encoder_cache_bytes: int = _flag(DEFAULT_ENCODER_CACHE_BYTES, "encoder-output cache size in bytes, 0 disables")
    output_width: int | None = _flag(None, "demo: rows' width; must equal the decoder's hidden_size",
                                     default_help="from --decoder-model-dir")
    decoder_model_dir: str | None = _flag(
        None, "decoder checkpoint whose config.json gives hidden_size and head_dim",
        default_help="demo: the prepared decoder when --output-width is not given; qwen2-vl: --model-dir")
    seed: int = _flag(_DEMO.seed, "demo encoder weight seed")
    image_size: int = _flag(_PROCESSOR.image_size, "demo resize side in pixels")
    patch_size: int = _flag(_DEMO.patch_size, "demo patch side in pixels")
    max_image_bytes: int = _flag(_PROCESSOR.max_image_bytes, "compressed bytes per image")
    max_image_pixels: int = _flag(_PROCESSOR.max_image_pixels, "width*height per image, checked from the header")
    max_images: int = _flag(_PROCESSOR.max_images, "images per request")
    max_request_pixels: int = _flag(_PROCESSOR.max_request_pixels,
                                    "width*height over a request's images to decode, from the headers")
    mrope_section: tuple[int, int, int] | None = _flag(
        None, "rotary pairs per (t,h,w) axis, e.g. 8,12,12", type=parse_mrope_section,
        default_help=f"demo: {','.join(map(str, DEFAULT_MROPE_SECTION))}; qwen2-vl: the checkpoint's")
    wedged_after_s: float = _flag(DEFAULT_WEDGED_AFTER_S,
                                  "health turns NOT_SERVING when images wait and no encode completes for this "
                                  "long (seconds; must exceed the longest encode)")
    background: str = _flag("white", "colour under transparent pixels: name, #RRGGBB or R,G,B")
    metrics_port: int = _flag(0, "serve Prometheus /metrics on this port, same host as --address (0: off)",
                              env=METRICS_PORT_ENV)

    def vision_config(self) -> VisionConfig:
        """Raises ValueError for any inconsistent flag (e.g. output width != decoder hidden size)."""
        processor = ProcessorConfig(image_size=self.image_size, max_image_bytes=self.max_image_bytes,
                                    max_image_pixels=self.max_image_pixels, max_images=self.max_images,
                                    max_request_pixels=self.max_request_pixels,
                                    background=parse_color(self.background))
        if self.encoder == "qwen2-vl":
            return self._qwen2_vl_config(processor)
        model_dir = self.decoder_model_dir
        if model_dir is None and self.output_width is None:
            model_dir = default_decoder_dir()
        decoder = DecoderGeometry.from_model_dir(model_dir) if model_dir is not None else None
        output_width = self.output_width if self.output_width is not None else decoder.hidden_size
        encoder = DemoEncoderConfig(output_width=output_width, image_size=self.image_size,
                                    patch_size=self.patch_size, seed=self.seed)
        return VisionConfig(encoder=encoder, processor=processor, address=self.address,
                            mrope_section=self.mrope_section or DEFAULT_MROPE_SECTION, decoder=decoder,
                            encoder_cache_bytes=self.encoder_cache_bytes, wedged_after_s=self.wedged_after_s,
                            metrics_port=self.metrics_port)

    def _qwen2_vl_config(self, processor: ProcessorConfig) -> VisionConfig:
        if self.model_dir is None:
            raise ValueError("--encoder qwen2-vl needs --model-dir (a Qwen2-VL checkpoint directory)")
        if self.output_width is not None:
            raise ValueError("--output-width applies to the demo encoder; Qwen2-VL's comes from its vision_config")
        encoder = Qwen2VLEncoderConfig(model_dir=self.model_dir, min_pixels=self.min_pixels,
                                       max_pixels=self.max_pixels)
        decoder = DecoderGeometry.from_model_dir(self.decoder_model_dir or self.model_dir)
        config = VisionConfig.for_qwen2_vl(encoder, processor, address=self.address, decoder=decoder,
                                           encoder_cache_bytes=self.encoder_cache_bytes,
                                           wedged_after_s=self.wedged_after_s, metrics_port=self.metrics_port)
        check_checkpoint_section(self.mrope_section, config.mrope_section, as_flag=True)
        return config
