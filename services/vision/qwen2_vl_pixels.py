"""Qwen2-VL's image preprocessing: dynamic resolution, CLIP normalization, patch rows.

The recipe is transformers' `Qwen2VLImageProcessorPil` (transformers 5.24,
models/qwen2_vl/image_processing_pil_qwen2_vl.py), step for step, so `pixel_values` and
`image_grid_thw` come out bit-identical:

    RGB uint8 [H0, W0, 3]
      --smart_resize(factor = patch * merge = 28, min/max pixels, aspect ratio <= 200)-->  (H, W)
      --PIL bicubic resize--> uint8 [H, W, 3]
      --rescale: float64 * (1/255) -> float32--> --normalize (x - CLIP mean) / CLIP std, float32-->
      pixels float32 [3, H, W]                                    (what the processor hands on)
      --patchify--> pixel_values float32 [gh * gw, 3 * T * P * P]  (what the tower consumes)

`patchify` orders rows block-major over merge x merge windows, exactly as transformers does,
so that the PatchMerger's `view(-1, embed * merge**2)` concatenates the 2x2 neighbours:

    grid (gh, gw) = (H / P, W / P); row index = ((bh * (gw/m) + bw) * m + mh) * m + mw
    where patch (h, w) = (bh * m + mh, bw * m + mw), m = merge size

and each row is (channel, temporal, ph, pw) flattened, the one still image repeated over the
T = 2 temporal slots (the Conv3d patch embed expects 2 frames; a still image is its own pair).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from services.common.errors import InvalidArgument

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Qwen2VLPixelConfig:
    """Qwen2-VL's preprocessing recipe; defaults are transformers' `Qwen2VLImageProcessor` defaults.

    min_pixels / max_pixels bound H * W after resizing (pixels, not patches): the defaults
    56*56 and 28*28*1280 give between 4 and 1280 merged tokens per image.
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    max_aspect_ratio: float = 200.0
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 1 <= min_pixels <= max_pixels, got min_pixels={self.min_pixels} "
                             f"max_pixels={self.max_pixels}")
        if self.max_pixels < self.factor ** 2:
            raise ValueError(f"max_pixels {self.max_pixels} is below one merged patch ({self.factor}^2)")
        if self.max_aspect_ratio < 1:
            raise ValueError(f"max_aspect_ratio must be >= 1, got {self.max_aspect_ratio}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or any(s <= 0 for s in self.image_std):
            raise ValueError(f"image_mean/image_std must be 3 values with std > 0, got "
                             f"{self.image_mean} / {self.image_std}")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (patch * merge = 28 for Qwen2-VL)."""
        return self.patch_size * self.merge_size


def check_source_size(width: int, height: int, config: Qwen2VLPixelConfig) -> None:
    """Refuse, from the header size alone, images the recipe cannot take. Raises InvalidArgument.

    Smaller than one patch on either side, or an aspect ratio past `max_aspect_ratio` (200,
    transformers' smart_resize limit).
    """
    if width < config.patch_size or height < config.patch_size:
        raise InvalidArgument(f"image is {width}x{height}; each side must be at least one patch "
                              f"({config.patch_size} pixels)")
    ratio = max(width, height) / min(width, height)
    if ratio > config.max_aspect_ratio:
        raise InvalidArgument(f"image is {width}x{height}, aspect ratio {ratio:.1f}; "
                              f"the limit is {config.max_aspect_ratio:g}")


def smart_resize(height: int, width: int, config: Qwen2VLPixelConfig) -> tuple[int, int]:
    """(H, W) both multiples of `factor`, H * W within [min_pixels, max_pixels], aspect kept.

    transformers' `smart_resize` verbatim in arithmetic (round, then floor/ceil on beta), so
    grids match. Raises InvalidArgument past the aspect-ratio limit.
    """
    check_source_size(width, height, config)
    factor = config.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > config.max_pixels:
        beta = math.sqrt((height * width) / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def normalize(rgb: Image.Image, config: Qwen2VLPixelConfig) -> torch.Tensor:
    """RGB PIL image -> float32 [3, H, W]: smart_resize, bicubic, rescale 1/255, CLIP mean/std."""
    height, width = smart_resize(rgb.height, rgb.width, config)
    resized = np.asarray(rgb.resize((width, height), Image.Resampling.BICUBIC))  # uint8 [H, W, 3]
    scaled = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)  # as transformers' rescale
    mean = np.asarray(config.image_mean, dtype=np.float32)
    std = np.asarray(config.image_std, dtype=np.float32)
    normalized = (scaled - mean) / std  # float32, channels last
    return torch.from_numpy(np.ascontiguousarray(normalized.transpose(2, 0, 1)))  # [3, H, W]


def patchify(pixels: torch.Tensor, config: Qwen2VLPixelConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[3, H, W] float32 -> (pixel_values [gh * gw, 3 * T * P * P], grid_thw (1, gh, gw) in patches).

    Row order and row layout as in the module docstring (transformers' `patchify`). Raises
    ValueError when H or W is not a multiple of patch * merge (a processor bug, not client input).
    """
    channels, height, width = pixels.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    if channels != 3 or height % config.factor or width % config.factor:
        raise ValueError(f"pixels {tuple(pixels.shape)} must be [3, H, W] with H, W multiples of {config.factor}")
    grid_h, grid_w = height // p, width // p
    patches = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
    patches = patches.unsqueeze(5).expand(*patches.shape[:5], t, p, p)  # still image -> T frames
    return patches.reshape(grid_h * grid_w, channels * t * p * p).contiguous(), (1, grid_h, grid_w)
