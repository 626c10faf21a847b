"""`linear` (services/decoder/linear.py) equals F.linear in both GEMM orientations."""

import torch
import torch.nn.functional as F

from services.decoder.linear import TRANSPOSED_ROWS, linear


def test_linear_equals_f_linear_row_major_for_every_row_count():
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 96), torch.randn(300)
    assert 3 in TRANSPOSED_ROWS and 16 in TRANSPOSED_ROWS and 1 not in TRANSPOSED_ROWS and 40 not in TRANSPOSED_ROWS
    for rows in (1, 2, 3, 4, 5, 16, 40):
        x = torch.randn(rows, 96)
        for b in (None, bias):
            y = linear(x, weight, b)
            assert y.shape == (rows, 300) and y.is_contiguous()
            torch.testing.assert_close(y, F.linear(x, weight, b), atol=1e-5, rtol=1e-6)
            if rows not in TRANSPOSED_ROWS:                   # the F.linear path itself: bit for bit
                assert torch.equal(y, F.linear(x, weight, b))
    x = torch.randn(2, 3, 96)                                 # other ranks: F.linear unchanged
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))
    x = torch.randn(3, 192)[:, ::2]                           # a strided input
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-5, rtol=1e-6)
