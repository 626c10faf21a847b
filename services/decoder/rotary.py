"""Rotary position embedding: ordinary RoPE and M-RoPE (split-half / rotate_half pairing).

Conventions follow transformers: `inv_freq = 1 / theta ** (arange(0, d, 2) / d)`, the angle
table is duplicated across both halves of the head (`cat(freqs, freqs)`), and
`x * cos + rotate_half(x) * sin`. M-RoPE (transformers' Qwen2-VL
`apply_multimodal_rotary_pos_emb`) gives frequency pair j the position of axis(j), where
`mrope_section = (t, h, w)` counts pairs per axis; the selected angles are repeated for both
halves. With equal coordinates on all axes it is ordinary RoPE.
"""

from __future__ import annotations

import torch

from services.common.mrope import check_mrope_section


class RotaryEmbedding:
    """Cos/sin tables for positions [num_tokens] (RoPE) or [3, num_tokens] (M-RoPE)."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, int, int] | None = None) -> None:
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        if mrope_section is not None:
            check_mrope_section(mrope_section, head_dim)
        self.head_dim = head_dim
        self.mrope_section = tuple(mrope_section) if mrope_section is not None else None
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq = 1.0 / (theta ** exponent)  # [head_dim / 2] float32

    def to(self, device: torch.device | str) -> RotaryEmbedding:
        """Keep the frequency table on `device`, where the positions arrive (this is no nn.Module,
        so the model's `.to()` does not move it). Returns self."""
        self.inv_freq = self.inv_freq.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (cos, sin), each [num_tokens, head_dim] in `dtype` (angles in float32).

        Raises:
            ValueError: [3, N] positions on a model without M-RoPE sections, or bad rank.
        """
        if positions.ndim == 1:
            freqs = positions[:, None].float() * self.inv_freq[None, :]  # [N, head_dim/2]
        elif positions.ndim == 2 and positions.shape[0] == 3:
            if self.mrope_section is None:
                raise ValueError("[3, N] M-RoPE positions need mrope_section")
            per_axis = positions[:, :, None].float() * self.inv_freq  # [3, N, head_dim/2]
            chunks, start = [], 0
            for axis, count in enumerate(self.mrope_section):
                chunks.append(per_axis[axis, :, start:start + count])
                start += count
            freqs = torch.cat(chunks, dim=-1)  # [N, head_dim/2]
        else:
            raise ValueError(f"positions must be [N] or [3, N], got shape {tuple(positions.shape)}")
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [num_tokens, heads, head_dim] by cos/sin [num_tokens, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin
