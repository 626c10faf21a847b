"""RotaryEmbedding.use_table: the cos/sin rows a decode step indexes are the values cos_sin computes."""

from __future__ import annotations

import pytest
import torch

from services.decoder.rotary import LongRope, RopeScaling, RotaryEmbedding

NUM_POSITIONS = 4096


def _pair(head_dim: int, scaling: RopeScaling | None = None) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    tabled, computed = RotaryEmbedding(head_dim, 10000.0, scaling=scaling), RotaryEmbedding(head_dim, 10000.0,
                                                                                             scaling=scaling)
    tabled.use_table(NUM_POSITIONS)
    return tabled, computed


@pytest.mark.parametrize("head_dim", [64, 80, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_are_the_computed_values_bit_for_bit(head_dim, dtype):
    """Any batch of positions (a lone decode row, a few, a prefill chunk, the table's last row) reads
    exactly what the seven-op computation gives, in both dtypes, including head dims whose angle
    rows end in a partial vector."""
    tabled, computed = _pair(head_dim)
    generator = torch.Generator().manual_seed(head_dim)
    batches = [torch.tensor([0]), torch.tensor([NUM_POSITIONS - 1]), torch.arange(100, 164),
               *(torch.randint(0, NUM_POSITIONS, (n,), generator=generator) for n in (1, 3, 17))]
    for positions in batches:
        for got, want in zip(tabled.cos_sin(positions, dtype), computed.cos_sin(positions, dtype)):
            assert got.dtype == dtype and got.is_contiguous() and got.shape == (positions.numel(), head_dim)
            assert torch.equal(got, want), positions


def test_a_scaled_rope_table_carries_its_attention_factor():
    inv_freq = tuple((1.0 / 10000.0 ** (torch.arange(0, 32, 2).float() / 32) / 4).tolist())
    tabled, computed = _pair(32, RopeScaling("yarn", inv_freq, attention_scaling=1.25))
    positions = torch.tensor([5, 900, 4000])
    for got, want in zip(tabled.cos_sin(positions, torch.float32), computed.cos_sin(positions, torch.float32)):
        assert torch.equal(got, want)
    assert not torch.equal(tabled.cos_sin(positions, torch.float32)[0],
                           RotaryEmbedding(32, 10000.0).cos_sin(positions, torch.float32)[0])


def test_a_position_past_the_table_is_an_error_not_a_wrong_row():
    tabled, _ = _pair(16)
    with pytest.raises(IndexError):
        tabled.cos_sin(torch.tensor([NUM_POSITIONS]), torch.float32)


def test_an_mrope_model_builds_no_table():
    rope = RotaryEmbedding(16, 10000.0, mrope_section=(2, 3, 3))
    rope.use_table(NUM_POSITIONS)
    assert rope.table_positions == 0 and rope.tables(torch.float32) is None


def test_longrope_keeps_computing():
    """A longrope row's position carries the long set's offset, past any table: no table is used."""
    inv = tuple([1.0] * 8)
    rope = RotaryEmbedding(16, 10000.0, scaling=RopeScaling("longrope", inv, 1.0, tuple([0.5] * 8), LongRope(64, 128)))
    rope.use_table(NUM_POSITIONS)
    assert rope.table_positions == 0
    assert rope.cos_sin(torch.tensor([3, 128 + 70]), torch.float32)[0].shape == (2, 16)
