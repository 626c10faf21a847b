"""Qwen2-VL's vision tower: Conv3d patch embed, 2-D rotary, per-image attention, 2x2 PatchMerger.

Module and parameter names mirror the checkpoint's `visual.*` tensors (patch_embed.proj,
blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}, merger.{ln_q,mlp.0,mlp.2}), so a
Qwen2-VL safetensors file loads by name. The math follows transformers 5.24
`Qwen2VisionTransformerPretrainedModel` (models/qwen2_vl/modeling_qwen2_vl.py):

    pixel_values [N, 3*T*P*P]  (N = sum of gh*gw over images; rows block-major, see qwen2_vl_pixels)
      -> Conv3d(kernel = stride = (T, P, P), no bias)             [N, embed]
      -> blocks x depth: x + attn(LN(x)), x + mlp(LN(x))           attention only within an image
         (cu_seqlens = [0, n0, n0+n1, ...]); q, k rotated by 2-D rotary: the first half of each
         head's rotary angles from the patch row h, the second half from the column w
      -> merger: LN, view [N/m^2, embed*m^2] (a 2x2 window is 4 consecutive rows), Linear-GELU-Linear
      -> rows [N/4, hidden]                                        hidden = the LLM's hidden size
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


@dataclass(frozen=True)
class Qwen2VLVisionConfig:
    """The checkpoint's `vision_config` (defaults: Qwen2-VL-2B/7B's tower, hidden = the LLM's width)."""

    depth: int = 32
    embed_dim: int = 1280
    hidden_size: int = 1536
    num_heads: int = 16
    mlp_ratio: float = 4.0
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("depth", "embed_dim", "hidden_size", "num_heads", "in_channels", "patch_size",
                     "temporal_patch_size", "spatial_merge_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"vision_config.{name} must be >= 1, got {getattr(self, name)}")
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            raise ValueError(f"embed_dim {self.embed_dim} / num_heads {self.num_heads} must be a head_dim "
                             "divisible by 4 (2-D rotary splits it into h and w halves of pairs)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def output_width(self) -> int:
        """The merger's output width: the LLM's hidden size (`hidden_size` in Qwen2-VL's vision_config)."""
        return self.hidden_size


def vision_position_ids(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """Per patch row its (h, w) patch coordinates, in the block-major row order: int64 [N, 2].

    As transformers' `get_vision_position_ids`: each image's (h, w) meshgrid is reordered into
    merge x merge windows, then repeated for each of its t frames.
    """
    positions = []
    for t, h, w in grid_thw:
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(block).transpose(1, 2).flatten()
        wpos = wpos.reshape(block).transpose(1, 2).flatten()
        positions.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    return torch.cat(positions)


def frame_seqlens(grid_thw: list[tuple[int, int, int]]) -> list[int]:
    """Cumulative patch-row counts [0, n0, n0+n1, ...], one segment per frame of each image, as
    transformers' `get_vision_cu_seqlens`: full attention never crosses a frame."""
    cu_seqlens = [0]
    for t, h, w in grid_thw:
        cu_seqlens.extend(cu_seqlens[-1] + h * w * (i + 1) for i in range(t))
    return cu_seqlens


class VisionRotary(nn.Module):
    """2-D rotary: head_dim/4 frequencies, angles [h*f, w*f] concatenated, then doubled to head_dim."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial_dim = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 4]

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids int64 [N, 2] -> (cos, sin) float32 [N, head_dim]."""
        freqs = position_ids[..., None].float() * self.inv_freq  # [N, 2, head_dim/4]
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [N, head_dim/2]: h half, w half
        angles = torch.cat([angles, angles], dim=-1)  # [N, head_dim], rotate_half pairs i with i + head_dim/2
        return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, embed]; cu_seqlens [0, n0, n0+n1, ...]: a row attends only to rows of its own segment
        (an image's frame; a window in Qwen2.5-VL's windowed blocks)."""
        num_rows = x.shape[0]
        q, k, v = self.qkv(x).reshape(num_rows, 3, self.num_heads, -1).unbind(1)  # each [N, heads, head_dim]
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return self.proj(segment_attention(q, k, v, cu_seqlens).reshape(num_rows, -1))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """Bidirectional attention of each row over the rows of its own segment [cu_seqlens[i], cu_seqlens[i+1]).

    q, k, v: [N, heads, head_dim] -> [N, heads, head_dim]. Segments of one length go through one batched
    scaled_dot_product_attention: a Qwen2.5-VL image is mostly equal windows, a request often equal-size
    images, and a call per segment would pay its dispatch once per window per layer.
    """
    out = torch.empty_like(q)
    starts_by_length: dict[int, list[int]] = {}
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end > start:
            starts_by_length.setdefault(end - start, []).append(start)
    for length, starts in starts_by_length.items():
        rows = torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)  # [S, length]
        qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))  # [S, heads, length, head_dim]
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out


class VisionMlp(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        hidden = int(config.embed_dim * config.mlp_ratio)
        self.fc1 = nn.Linear(config.embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, config.embed_dim)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm block; `norm` and `mlp` are Qwen2-VL's LayerNorm and fc1/fc2 MLP unless given."""

    def __init__(self, config: Qwen2VLVisionConfig, norm: type[nn.Module] = nn.LayerNorm,
                 mlp: type[nn.Module] = VisionMlp) -> None:
        super().__init__()
        self.norm1 = norm(config.embed_dim, eps=1e-6)
        self.norm2 = norm(config.embed_dim, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = mlp(config)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.embed_dim, self.shape[1:], stride=self.shape[1:], bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.reshape(-1, *self.shape).to(self.proj.weight.dtype)  # [N, C, T, P, P]
        return self.proj(x).reshape(x.shape[0], -1)  # [N, embed]


class PatchMerger(nn.Module):
    """Norm, then m x m neighbours concatenated, Linear-GELU-Linear to `config.output_width`."""

    def __init__(self, config: Qwen2VLVisionConfig, norm: type[nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.spatial_merge_size ** 2
        self.ln_q = norm(config.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(),
                                 nn.Linear(self.merged_dim, config.output_width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged_dim))  # [N / m^2, hidden]


class Qwen2VLVisionTower(nn.Module):
    """`visual.*` of a Qwen2-VL checkpoint. forward(pixel_values [N, 3*T*P*P], grids) -> [N/4, hidden]."""

    def __init__(self, config: Qwen2VLVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.rotary_pos_emb = VisionRotary(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """grid_thw: per image (t, gh, gw) in patches; rows of one frame are one attention segment."""
        cos, sin = self.rotary_pos_emb(vision_position_ids(grid_thw, self.config.spatial_merge_size))
        cu_seqlens = frame_seqlens(grid_thw)
        x = self.patch_embed(pixel_values)  # [N, embed]
        for block in self.blocks:
            x = block(x, cu_seqlens, cos, sin)
        return self.merger(x)  # [N / m^2, hidden]
