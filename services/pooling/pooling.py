"""Pooling: one vector per sequence from a padded batch of hidden states.

Padding contributes neither vectors nor a denominator: the mean of [h0, h1, pad] is (h0 + h1) / 2.
"last" and "cls" find the last / first *visible* token from the mask, so they are correct with
either padding side:

    right padding   mask = [1 1 1 0 0]   cls -> 0, last -> 2
    left padding    mask = [0 0 1 1 1]   cls -> 2, last -> 4
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.pooling.st_config import POOLING_MODES


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool a padded batch.

    Args:
        hidden: [B, T, H] final hidden states, any float dtype.
        mask: [B, T] attention mask (bool or 0/1 ints); True/1 marks a visible token.
        mode: "mean" (visible tokens averaged, as sentence-transformers' mean_tokens),
            "cls" (first visible token) or "last" (last visible token, as its lasttoken).

    Returns:
        [B, H] float32.

    Raises:
        ValueError: shapes disagree, a row has no visible token, or an unknown mode.
    """
    if hidden.ndim != 3 or mask.shape != hidden.shape[:2]:
        raise ValueError(f"pool needs hidden [B, T, H] and mask [B, T]; got {tuple(hidden.shape)} and {tuple(mask.shape)}")
    visible = mask.bool()  # [B, T]
    if not visible.any(dim=1).all():
        raise ValueError("every sequence needs at least one visible token")
    if mode == "mean":
        weights = visible.unsqueeze(-1).float()  # [B, T, 1]
        summed = (hidden.float() * weights).sum(dim=1)  # [B, H]
        return summed / weights.sum(dim=1)  # divisor counts visible tokens only
    if mode not in ("cls", "last"):
        raise ValueError(f"pooling mode must be one of {POOLING_MODES}, got {mode!r}")
    positions = torch.arange(visible.shape[1], device=visible.device).expand_as(visible)  # [B, T]
    if mode == "last":
        index = positions.masked_fill(~visible, -1).amax(dim=1)  # [B]
    else:
        index = positions.masked_fill(~visible, visible.shape[1]).amin(dim=1)  # [B]
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, index].float()  # [B, H]


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    """Unit L2 norm along the last dim (`F.normalize`, eps 1e-12), so dot product = cosine similarity."""
    return F.normalize(vectors, p=2.0, dim=-1)
