"""Vision service configuration: where it listens, the preprocessing recipe, the encoder, M-RoPE sections."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from services.common.liveness import DEFAULT_WEDGED_AFTER_S, check_wedged_after_s
from services.common.metrics import check_metrics_port
from services.common.server import DEFAULT_PORTS
from services.vision.encoder import DemoEncoderConfig, decoder_geometry
from services.vision.processor import ProcessorConfig
from services.vision.qwen2_vl_encoder import Qwen2VLEncoderConfig, read_checkpoint

DEFAULT_ENCODER_CACHE_BYTES = 256 * 1024 * 1024

DEFAULT_MROPE_SECTION = (8, 12, 12)  # pairs per (t, h, w) axis for head_dim 64, e.g. SmolLM2-135M


def parse_sections(value: str) -> tuple[int, int, int]:
    """Parse "8,12,12" into (8, 12, 12). Raises ValueError naming the value."""
    try:
        sections = tuple(int(part) for part in value.split(","))
    except ValueError as error:
        raise ValueError(f"mrope_section must be three comma-separated integers, got {value!r}") from error
    if len(sections) != 3:
        raise ValueError(f"mrope_section must have 3 entries (t, h, w), got {value!r}")
    return sections  # type: ignore[return-value]


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
    address: str = f"127.0.0.1:{DEFAULT_PORTS['vision']}"
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION
    decoder: DecoderGeometry | None = None
    encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES  # 0 disables the encoder cache
    wedged_after_s: float = DEFAULT_WEDGED_AFTER_S  # encodes waiting, none completed this long -> NOT_SERVING
    metrics_port: int = field(default=0, metadata={
        "help": "serve Prometheus /metrics on this port, same host as --address (0: off)",
        "env": "TESSERA_METRICS_PORT"})

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
        if len(self.mrope_section) != 3 or any(s < 1 for s in self.mrope_section):
            raise ValueError(f"mrope_section must be 3 positive pair counts (t, h, w), got {self.mrope_section}")
        output_width = self._check_encoder()
        if self.decoder is None:
            return
        if output_width != self.decoder.hidden_size:
            raise ValueError(f"output_width {output_width} must equal the decoder's hidden_size "
                             f"{self.decoder.hidden_size}")
        if 2 * sum(self.mrope_section) != self.decoder.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} covers {sum(self.mrope_section)} rotary pairs; "
                             f"the decoder's head_dim {self.decoder.head_dim} has {self.decoder.head_dim // 2}")

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
        if self.mrope_section != checkpoint.mrope_section:
            raise ValueError(f"mrope_section {self.mrope_section} differs from the checkpoint's "
                             f"{checkpoint.mrope_section}")
        return checkpoint.vision.hidden_size
