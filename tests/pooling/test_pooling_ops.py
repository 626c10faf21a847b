"""`pool` / `normalize` on hand-built hidden states: padding never leaks into the result."""

from __future__ import annotations

import pytest
import torch

from services.pooling.pooling import normalize, pool

PAD = 1e6  # padding rows hold garbage that would dominate any leak


def _batch():
    """Two sequences, lengths 2 and 3, right-padded to T=4, H=3."""
    hidden = torch.full((2, 4, 3), PAD)
    hidden[0, :2] = torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]])
    hidden[1, :3] = torch.tensor([[0.0, 0.0, 3.0], [3.0, 0.0, 0.0], [0.0, 6.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    return hidden, mask


def test_mean_excludes_padding_from_sum_and_divisor():
    hidden, mask = _batch()
    out = pool(hidden, mask, "mean")
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    # (h0 + h1) / 2, not / 4 (padding in the divisor) and no 1e6 (padding in the sum)
    torch.testing.assert_close(out[0], torch.tensor([2.0, 3.0, 4.0]))
    torch.testing.assert_close(out[1], torch.tensor([1.0, 2.0, 1.0]))
    torch.testing.assert_close(pool(hidden, mask.bool(), "mean"), out)


def test_mean_is_independent_of_padding_length():
    hidden, mask = _batch()
    longer = torch.cat([hidden, torch.full((2, 5, 3), PAD)], dim=1)
    longer_mask = torch.cat([mask, torch.zeros(2, 5, dtype=mask.dtype)], dim=1)
    torch.testing.assert_close(pool(longer, longer_mask, "mean"), pool(hidden, mask, "mean"))


def test_last_with_right_padding():
    hidden, mask = _batch()
    out = pool(hidden, mask, "last")
    torch.testing.assert_close(out, torch.stack([hidden[0, 1], hidden[1, 2]]))


def test_last_and_cls_with_left_padding():
    hidden, mask = _batch()
    # the same sequences, left-padded: visible tokens moved to the end of each row
    left = torch.full_like(hidden, PAD)
    left_mask = torch.zeros_like(mask)
    for row, n in enumerate(mask.sum(1).tolist()):
        left[row, -n:] = hidden[row, :n]
        left_mask[row, -n:] = 1
    torch.testing.assert_close(pool(left, left_mask, "last"), pool(hidden, mask, "last"))
    torch.testing.assert_close(pool(left, left_mask, "cls"), torch.stack([hidden[0, 0], hidden[1, 0]]))
    torch.testing.assert_close(pool(left, left_mask, "mean"), pool(hidden, mask, "mean"))


def test_cls_is_first_token_with_right_padding():
    hidden, mask = _batch()
    torch.testing.assert_close(pool(hidden, mask, "cls"), hidden[:, 0])


def test_half_precision_input_pools_to_float32():
    hidden, mask = _batch()
    out = pool(hidden.bfloat16(), mask, "mean")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[0], torch.tensor([2.0, 3.0, 4.0]))


def test_normalize_gives_unit_rows_in_the_same_direction():
    v = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
    torch.testing.assert_close(normalize(v), torch.tensor([[0.6, 0.8], [0.0, -1.0]]))


@pytest.mark.parametrize("mode", ["mean", "cls", "last"])
def test_row_without_visible_tokens_is_refused(mode):
    hidden, mask = _batch()
    mask[1] = 0
    with pytest.raises(ValueError, match="at least one visible token"):
        pool(hidden, mask, mode)


def test_bad_shapes_and_modes_are_refused():
    hidden, mask = _batch()
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        pool(hidden, mask[:, :3], "mean")
    with pytest.raises(ValueError, match="'max'"):
        pool(hidden, mask, "max")
