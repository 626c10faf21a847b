"""Qwen2.5-VL's vision tower: Qwen2-VL's, with window attention, RMSNorm, a gated SiLU MLP.

Module and parameter names mirror the checkpoint's `visual.*` tensors (patch_embed.proj,
blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.{gate,up,down}_proj}, merger.{ln_q,mlp.0,mlp.2}), so a
Qwen2.5-VL safetensors file loads by name. The math follows transformers 5.24
`Qwen2_5_VisionTransformerPretrainedModel` (models/qwen2_5_vl/modeling_qwen2_5_vl.py); what it
shares with Qwen2-VL (Conv3d patch embed, 2-D rotary, attention, merger) is qwen2_vl_tower's:

    pixel_values [N, 3*T*P*P]  (rows block-major over m x m merge groups, see qwen2_vl_pixels)
      -> Conv3d patch embed                                         [N, embed]
      -> rows (and their rotary cos/sin) permuted into window order, one merge group at a time
      -> blocks x depth: x + attn(RMSNorm(x)), x + down(silu(gate(RMSNorm(x))) * up(RMSNorm(x)))
         attention within a window (`window_index`), or, in `fullatt_block_indexes`, within a frame
      -> merger: RMSNorm, m x m neighbours concatenated, Linear-GELU-Linear      [N/m^2, out_hidden]
      -> merged rows permuted back (the inverse of the window order)
      -> rows [N/m^2, out_hidden_size]                              out_hidden = the LLM's hidden size

A merge group's m^2 rows stay together in the window order, so the merger sees the same groups
in either order and one inverse permutation of its output restores (t, h/m, w/m) raster order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.vision.qwen2_vl_tower import (
    ACTIVATIONS,
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    VisionRotary,
    frame_seqlens,
    vision_position_ids,
)


@dataclass(frozen=True)
class Qwen2_5_VLVisionConfig:  # noqa: N801 (transformers' class name)
    """The checkpoint's `vision_config`; defaults are transformers' `Qwen2_5_VLVisionConfig` defaults.

    hidden_size is the ViT's width (Qwen2-VL calls it embed_dim); out_hidden_size the merger's
    output, the LLM's width. window_size is in pixels: windows are window_size / (patch * merge)
    merged tokens on a side (112 / 28 = 4 for the released checkpoints).
    """

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    out_hidden_size: int = 3584
    num_heads: int = 16
    hidden_act: str = "silu"
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
        for name in ("depth", "hidden_size", "intermediate_size", "out_hidden_size", "num_heads", "in_channels",
                     "patch_size", "temporal_patch_size", "spatial_merge_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"vision_config.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(f"hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a head_dim "
                             "divisible by 4 (2-D rotary splits it into h and w halves of pairs)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
        if self.merged_window < 1:
            raise ValueError(f"vision_config.window_size {self.window_size} is below one merged patch "
                             f"({self.patch_size * self.spatial_merge_size} pixels)")

    @property
    def embed_dim(self) -> int:
        """The ViT's width, under qwen2_vl_tower's name for it."""
        return self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def output_width(self) -> int:
        return self.out_hidden_size

    @property
    def merged_window(self) -> int:
        """Merged tokens on a window's side."""
        return self.window_size // self.spatial_merge_size // self.patch_size


def window_index(grid_thw: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The window order of the merged tokens and the windows' boundaries, as transformers'
    `get_vision_window_index`.

    Each frame's (h/m, w/m) grid of merged tokens is tiled from its top left by `window` x `window`
    tiles (the last row and column of tiles are cut short when the grid is not a multiple); tiles in
    raster order, a tile's tokens in raster order. Merged grid 3 x 5, window 2:

        token ids (raster)      index = [0 1 5 6 | 2 3 7 8 | 4 9 | 10 11 | 12 13 | 14]
         0  1 |  2  3 |  4      cu_window_seqlens = m^2 x [0, 4, 8, 10, 12, 14, 15]
         5  6 |  7  8 |  9
        ------+-------+---
        10 11 | 12 13 | 14

    Images and frames follow one another (token ids count on across them).

    Returns:
        index: int64 [N/m^2], the merged token (its (t, h/m, w/m) raster id) at each window position.
        cu_window_seqlens: cumulative patch-row counts (merged tokens x m^2) at each window's end, from 0.
    """
    index, cu_seqlens, offset = [], [0], 0
    for t, h, w in grid_thw:
        ids = torch.arange(t * (h // merge) * (w // merge)).reshape(t, h // merge, w // merge) + offset
        offset += ids.numel()
        for frame in ids:  # [h/m, w/m]
            for top in range(0, frame.shape[0], window):
                for left in range(0, frame.shape[1], window):
                    tile = frame[top:top + window, left:left + window].flatten()
                    index.append(tile)
                    cu_seqlens.append(cu_seqlens[-1] + tile.numel() * merge * merge)
    return torch.cat(index), cu_seqlens


def _in_window_order(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[N, d] rows -> the same rows, merge groups (m^2 consecutive rows) permuted by `index`."""
    return x.reshape(index.numel(), -1, x.shape[-1])[index].reshape(x.shape)


class GatedMlp(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), every projection with a bias."""

    def __init__(self, config: Qwen2_5_VLVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.RMSNorm):
    """RMSNorm over the last dimension in float32, as transformers' Qwen2_5_VLRMSNorm (eps 1e-6)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Qwen2_5_VLVisionTower(nn.Module):  # noqa: N801 (transformers' family name)
    """`visual.*` of a Qwen2.5-VL checkpoint. forward(pixel_values [N, 3*T*P*P], grids) -> [N/m^2, out_hidden]."""

    def __init__(self, config: Qwen2_5_VLVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.rotary_pos_emb = VisionRotary(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(config, norm=RMSNorm, mlp=GatedMlp) for _ in range(config.depth))
        self.merger = PatchMerger(config, norm=RMSNorm)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """grid_thw: per image (t, gh, gw) in patches. Rows come out in (t, gh/m, gw/m) raster order."""
        merge = self.config.spatial_merge_size
        index, window_seqlens = window_index(grid_thw, merge, self.config.merged_window)
        full_seqlens = frame_seqlens(grid_thw)  # window order keeps each frame's rows within its span
        cos, sin = self.rotary_pos_emb(vision_position_ids(grid_thw, merge))  # [N, head_dim] each
        cos, sin = _in_window_order(cos, index), _in_window_order(sin, index)
        x = _in_window_order(self.patch_embed(pixel_values), index)  # [N, embed], window order
        for i, block in enumerate(self.blocks):
            x = block(x, full_seqlens if i in self.config.fullatt_block_indexes else window_seqlens, cos, sin)
        return self.merger(x)[torch.argsort(index)]  # [N / m^2, out_hidden], raster order again
