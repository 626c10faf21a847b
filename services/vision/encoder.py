"""Image encoders: normalized pixels -> rows in the decoder's hidden width.

!!! The demo encoder has RANDOM (seeded) weights. It proves the plumbing -- shapes, wire format,
!!! content hashes, placeholder expansion, M-RoPE positions, KV caching -- and NOT answers: no
!!! language model was trained against its projector, so a decoder fed these rows cannot
!!! describe the image. `GetInfo` reports encoder="demo" so no client mistakes it for a VLM.

The demo architecture is a fixed-resolution ViT (Dosovitskiy et al.; projector as in
LLaVA):

    pixels [N, 3, S, S]
      -> Conv2d(kernel = stride = patch)          [N, width, S/p, S/p]
      -> flatten raster (h, w) + learned positions [N, P, width]      P = (S/p)^2
      -> TransformerEncoderLayer x layers (bidirectional, pre-norm, GELU)
      -> LayerNorm -> Linear -> GELU -> Linear     [N, P, output_width]

Weights come from `torch.manual_seed(seed)` inside a forked RNG, so every process that builds a
`DemoEncoder` with the same config gets identical weights, and the revision (sha256 over the
weights' names, shapes, dtypes and bytes) says so.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.common.checkpoint import CheckpointConfig


@dataclass(frozen=True)
class EncoderOutput:
    """One image after the encoder.

    rows: [t*h*w, output_width] float32 on CPU, rows in (t, h, w) raster order.
    grid_thw: (t, h, w) in LLM units (after any patch merge).
    """

    rows: torch.Tensor
    grid_thw: tuple[int, int, int]


class ImageEncoder(ABC):
    """Contract shared by the demo and Qwen2-VL encoders.

    `encode` takes the processor's pixels (a list of float32 [3, H, W] tensors, normalized as
    that encoder's processor documents) and returns, per image, `EncoderOutput` with rows
    [prod(grid_thw), output_width] float32 on CPU. `revision` is a short hex digest of the
    weights: equal revisions mean equal outputs for equal pixels, and it enters every content
    hash. `name` is what GetInfo reports ("demo", "qwen2-vl" or "qwen2.5-vl"). Implementations are not
    thread-safe; the servicer serializes calls.
    """

    name: str
    revision: str
    output_width: int

    @abstractmethod
    def encode(self, pixels: list[torch.Tensor]) -> list[EncoderOutput]:
        """Raises ValueError for pixels of the wrong shape (a processor bug, not client input)."""


@dataclass(frozen=True)
class DemoEncoderConfig:
    """The demo tower. `output_width` must equal the decoder's hidden size."""

    output_width: int
    image_size: int = 64
    patch_size: int = 8
    width: int = 128
    heads: int = 4
    layers: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for field in ("output_width", "image_size", "patch_size", "width", "heads", "layers"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be a multiple of heads {self.heads}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        side = self.image_size // self.patch_size
        return (1, side, side)


class _DemoTower(nn.Module):
    def __init__(self, c: DemoEncoderConfig) -> None:
        super().__init__()
        num_patches = (c.image_size // c.patch_size) ** 2
        self.patch = nn.Conv2d(3, c.width, c.patch_size, stride=c.patch_size)
        self.position = nn.Parameter(torch.randn(num_patches, c.width) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(c.width, c.heads, 4 * c.width, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.width)
        self.projector = nn.Sequential(nn.Linear(c.width, c.output_width), nn.GELU(),
                                       nn.Linear(c.output_width, c.output_width))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2) + self.position  # [N, P, width], raster (h, w)
        for block in self.blocks:
            x = block(x)  # no mask: every patch attends to every patch of its image
        return self.projector(self.norm(x))  # [N, P, output_width]


class DemoEncoder(ImageEncoder):
    """Seeded random-weight ViT + projector (see the module docstring: plumbing, not answers)."""

    name = "demo"

    def __init__(self, config: DemoEncoderConfig) -> None:
        self.config = config
        with torch.random.fork_rng(devices=[]):  # seed the weights without disturbing the caller's RNG
            torch.manual_seed(config.seed)
            self.model = _DemoTower(config).eval()
        self.output_width = config.output_width
        self.revision = state_dict_digest(self.model)

    def encode(self, pixels: list[torch.Tensor]) -> list[EncoderOutput]:
        """pixels: list of float32 [3, S, S] in [-1, 1] -> per image rows [P, output_width] float32."""
        if not pixels:
            return []
        expected = (3, self.config.image_size, self.config.image_size)
        for i, p in enumerate(pixels):
            if tuple(p.shape) != expected:
                raise ValueError(f"pixels[{i}] has shape {tuple(p.shape)}; the demo encoder needs {expected}")
        with torch.inference_mode():
            rows = self.model(torch.stack(pixels).float())  # [N, P, output_width]
        grid = self.config.grid_thw
        return [EncoderOutput(rows=r.contiguous().clone(), grid_thw=grid) for r in rows]


def state_dict_digest(module: nn.Module, length: int = 16) -> str:
    """Short sha256 hex over every tensor's name, shape, dtype and little-endian bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()[:length]


def decoder_geometry(model_dir: str | Path) -> tuple[int, int]:
    """(hidden_size, head_dim) of a Hugging Face decoder checkpoint (services/common/checkpoint.py).

    Raises ValueError when config.json or its hidden_size is missing.
    """
    checkpoint = CheckpointConfig.read(model_dir)
    if checkpoint.hidden_size is None:
        raise ValueError(f"{checkpoint.model_dir / 'config.json'} has no hidden_size")
    return checkpoint.hidden_size, checkpoint.head_dim or checkpoint.hidden_size
