"""The C decode GEMM (tessera/decoder/kernels/gemm.c through linear.CpuGemm): y = x @ W.T (+ b) for
decode-sized batches, float32 and bfloat16 weights, against float64 references; a row's numbers do
not depend on its batch, the thread count or the build variant; bf16 without native bf16 widens
large batches for MKL; the backend's auto choice and refusals. Greedy ids and logits through the
engine with either backend: tests/decoder/test_smollm.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.decoder.config import DecoderConfig
from tessera.decoder.kernels import native
from tessera.decoder.linear import KERNEL_ROWS, WIDENED_BF16_KERNEL_ROWS, CpuGemm, linear

pytestmark = pytest.mark.skipif(native.unavailable("float32") is not None, reason="no C compiler with OpenMP")


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("in_features", [576, 100, 7])  # a multiple of 8; a tail of 4; tail only
@pytest.mark.parametrize("out_features", [300, 301, 1])  # tiles of 3 weight rows; tails of 1 and 2
def test_float32_equals_a_float64_reference(in_features, out_features):
    torch.manual_seed(in_features + out_features)
    gemm = CpuGemm()
    weight, bias = torch.randn(out_features, in_features) * 0.1, torch.randn(out_features)
    for rows in (1, 2, 3, 4, 5, 16, 31, KERNEL_ROWS):
        x = torch.randn(rows, in_features)
        assert gemm.takes(x, weight)
        for b in (None, bias):
            y = linear(x, weight, b, gemm)
            assert y.shape == (rows, out_features) and y.dtype == torch.float32 and y.is_contiguous()
            reference = _reference(x, weight, b)
            error = (y.double() - reference).abs().max().item()
            assert error <= 1e-6 * max(1.0, reference.abs().max().item()) * in_features ** 0.5, (rows, error)


def test_bfloat16_weights_round_once_from_a_float32_sum():
    torch.manual_seed(1)
    gemm = CpuGemm()
    weight, bias = (torch.randn(257, 576) * 0.05).bfloat16(), torch.randn(257).bfloat16()
    for rows in (1, 4, 9, KERNEL_ROWS):
        x = torch.randn(rows, 576).bfloat16()
        for b in (None, bias):
            y = linear(x, weight, b, gemm)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, 257)
            exact = _reference(x, weight, b)  # bf16 x bf16 products are exact; only the sum order differs
            rounded = exact.to(torch.bfloat16)
            # one rounding of a float32 sum: the exact value rounded, or its neighbour where the sum
            # lies within float32 error of a rounding boundary
            ulp = (rounded.double().abs() * 2 ** -7).clamp_min(2 ** -133)
            assert ((y.double() - rounded.double()).abs() <= ulp).all()
            assert (y == rounded).double().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_numbers_do_not_depend_on_its_batch_or_the_thread_count(dtype):
    torch.manual_seed(2)
    library = native.load()
    kernel = library.tessera_gemm_f32 if dtype == torch.float32 else library.tessera_gemm_bf16
    weight, bias = (torch.randn(3 * 97 + 2, 589) * 0.1).to(dtype), torch.randn(3 * 97 + 2).to(dtype)  # k tail 5

    def gemm(x, threads):
        y = torch.empty(x.shape[0], weight.shape[0], dtype=dtype)
        kernel(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), bias.data_ptr(), y.data_ptr(),
               weight.shape[0], threads)
        return y

    batch = torch.randn(KERNEL_ROWS, 589)
    full = gemm(batch, 2)
    for threads in (1, 3):
        assert torch.equal(gemm(batch, threads), full), threads
    for start, rows in ((0, 1), (5, 1), (3, 6), (17, 15)):
        alone = gemm(batch[start:start + rows].contiguous(), 2)
        assert torch.equal(alone, full[start:start + rows]), (start, rows)


def test_the_portable_build_gives_the_same_bits():
    """The AVX2 code and the portable code sum in one order."""
    if not {"avx2", "fma"} <= native.cpu_flags():
        pytest.skip("no AVX2 + FMA on this CPU: both builds are the portable code")
    assert native.gemm_variant() == "avx2"
    torch.manual_seed(3)
    portable = native.build(portable=True)
    assert native.gemm_variant(portable) == "portable"
    weight, bias = torch.randn(100, 203) * 0.1, torch.randn(100)
    x = torch.randn(11, 203)
    expected = CpuGemm()(x, weight, bias)
    y = torch.empty(11, 100)
    portable.tessera_gemm_f32(x.data_ptr(), 11, 203, weight.data_ptr(), bias.data_ptr(), y.data_ptr(), 100, 2)
    assert torch.equal(y, expected)
    wb, bb = weight.bfloat16(), bias.bfloat16()
    expected = CpuGemm()(x, wb, bb)
    yb = torch.empty(11, 100, dtype=torch.bfloat16)
    portable.tessera_gemm_bf16(x.data_ptr(), 11, 203, wb.data_ptr(), bb.data_ptr(), yb.data_ptr(), 100, 2)
    assert torch.equal(yb, expected)


def test_other_inputs_go_to_f_linear_bit_for_bit():
    gemm = CpuGemm()
    weight, bias = torch.randn(64, 32), torch.randn(64)
    for x in (torch.randn(KERNEL_ROWS + 1, 32), torch.randn(2, 3, 32), torch.randn(0, 32), torch.randn(2, 16)):
        assert not gemm.takes(x, weight)
        if x.shape[-1] == weight.shape[1]:
            assert torch.equal(linear(x, weight, bias, gemm), F.linear(x, weight, bias))
        else:  # a width mismatch is torch's error, never a read past the weights
            with pytest.raises(RuntimeError):
                linear(x, weight, bias, gemm)
    half = torch.randn(4, 32).half()
    assert not gemm.takes(half, weight.half())
    assert torch.equal(linear(half, weight.half(), None, gemm), F.linear(half, weight.half()))


def test_bf16_without_native_bf16_takes_every_batch_and_widens_large_ones_for_mkl():
    torch.manual_seed(4)
    gemm = CpuGemm(native_bf16=False)
    weight, bias = (torch.randn(96, 64) * 0.1).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(WIDENED_BF16_KERNEL_ROWS + 7, 64).bfloat16()
    assert gemm.takes(x, weight) and not CpuGemm(native_bf16=True).takes(x, weight)
    y = linear(x, weight, bias, gemm)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x.float(), weight.float(), bias.float()).bfloat16())
    small = linear(x[:5], weight, bias, gemm)  # in the kernel: the same rounding of an fp32 sum
    assert (small.float() - y[:5].float()).abs().max() <= y[:5].float().abs().max() * 2 ** -7


def test_the_linear_backend_auto_choice_and_refusals(tiny_llama):
    decoder_dir = str(tiny_llama)
    expected = "torch" if "avx512f" in native.cpu_flags() else "cpu"  # the AVX2 kernel, measured where it wins
    assert DecoderConfig(model_dir=decoder_dir, dtype="float32").linear_backend == expected
    assert DecoderConfig(model_dir=decoder_dir, dtype="float32", linear_backend="torch").linear_backend == "torch"
    assert DecoderConfig(model_dir=decoder_dir, dtype="float32", linear_backend="cpu").linear_backend == "cpu"
    with pytest.raises(ValueError, match="cpu linear backend computes float32 and bfloat16 only, got dtype 'float16'"):
        DecoderConfig(model_dir=decoder_dir, dtype="float16", linear_backend="cpu")
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        DecoderConfig(model_dir=decoder_dir, linear_backend="mkl")
