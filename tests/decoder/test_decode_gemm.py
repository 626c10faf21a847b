"""The C GEMM (services/decoder/kernels/gemm.c through linear.CpuGemm / PackedWeight): y = x @ W.T (+ b)
on weights packed into panels, for every row count, float32 and bfloat16 weights, against float64
references; a row's numbers do not depend on its batch, the thread count or the build variant;
packing releases the model's row-major weights (a tied lm_head keeps the embedding); bad inputs
are refused; the backend's auto choice and refusals. Greedy ids and logits through the engine with
either backend: tests/decoder/test_smollm.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.decoder.config import DecoderConfig
from services.decoder.engine_parts import resolve_backends
from services.decoder.kernels import native
from services.decoder.linear import (
    BF16_PANEL_ORDER,
    PANEL_WIDTH,
    CpuGemm,
    Linear,
    attach_gemm,
    linear,
    resolve_linear_backend,
)

pytestmark = pytest.mark.skipif(native.unavailable("float32") is not None, reason="no C compiler with OpenMP")


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()


def test_packing_lays_out_panels_of_output_columns():
    weight = torch.arange(35 * 3, dtype=torch.float32).reshape(35, 3)  # two full panels and a tail of 3
    packed = CpuGemm().pack(weight)
    assert packed.panels.shape == (3, 3, PANEL_WIDTH) and packed.panels.is_contiguous()
    for n in range(35):
        assert torch.equal(packed.panels[n // PANEL_WIDTH, :, n % PANEL_WIDTH], weight[n])
    assert not packed.panels[2, :, 3:].any()  # zero past the last column
    bf16 = CpuGemm().pack(weight.bfloat16()).panels  # rows stored in the order AVX2 widens them
    assert bf16.shape == packed.panels.shape
    assert torch.equal(bf16[..., list(BF16_PANEL_ORDER)], packed.panels.bfloat16())


@pytest.mark.parametrize("in_features", [576, 100, 7])
@pytest.mark.parametrize("out_features", [320, 301, 1])  # whole panels; a tail of 13; a tail only
def test_float32_equals_a_float64_reference(in_features, out_features):
    torch.manual_seed(in_features + out_features)
    weight, bias = torch.randn(out_features, in_features) * 0.1, torch.randn(out_features)
    packed = CpuGemm().pack(weight)
    # micro-tiles of 6; decode sizes (threads split the panels) up to 96 rows, prefill sizes past it
    # (threads split the rows, chunks of 96)
    for rows in (1, 2, 5, 6, 7, 16, 31, 32, 47, 48, 49, 96, 97, 130, 200):
        x = torch.randn(rows, in_features)
        for b in (None, bias):
            y = linear(x, weight, b, packed)
            assert y.shape == (rows, out_features) and y.dtype == torch.float32 and y.is_contiguous()
            reference = _reference(x, weight, b)
            error = (y.double() - reference).abs().max().item()
            assert error <= 1e-6 * max(1.0, reference.abs().max().item()) * in_features ** 0.5, (rows, error)


def test_bfloat16_weights_round_once_from_a_float32_sum():
    torch.manual_seed(1)
    weight, bias = (torch.randn(257, 576) * 0.05).bfloat16(), torch.randn(257).bfloat16()
    packed = CpuGemm().pack(weight)
    assert packed.panels.dtype == torch.bfloat16  # half the bytes streamed
    for rows in (1, 4, 9, 32, 100):
        x = torch.randn(rows, 576).bfloat16()
        for b in (None, bias):
            y = packed(x, b)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, 257)
            exact = _reference(x, weight, b)  # bf16 x bf16 products are exact; only the sum order differs
            rounded = exact.to(torch.bfloat16)
            # one rounding of a float32 sum: the exact value rounded, or its neighbour where the sum
            # lies within float32 error of a rounding boundary
            ulp = (rounded.double().abs() * 2 ** -7).clamp_min(2 ** -133)
            assert ((y.double() - rounded.double()).abs() <= ulp).all()
            assert (y == rounded).double().mean() > 0.99


def _blocked_fma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The kernel's stated order (gemm.c): per block of 128 k, fma over k in increasing k from 0;
    block partials added in order; then + bias. A float32 fma is modelled as a float64 product
    (exact for two floats) plus a float64 add, rounded to float32: the same value except in rare
    double-rounding cases (none for this seed)."""
    total = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for k0 in range(0, x.shape[1], block):
        part = torch.zeros_like(total)
        for k in range(k0, min(k0 + block, x.shape[1])):
            part = (part.double() + x[:, k:k + 1].double() * weight[:, k].double()).float()
        total = total + part
    return total + bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_numbers_do_not_depend_on_its_batch_or_the_thread_count(dtype):
    torch.manual_seed(2)
    weight, bias = (torch.randn(3 * PANEL_WIDTH + 5, 589) * 0.1).to(dtype), torch.randn(3 * PANEL_WIDTH + 5).to(dtype)
    packed = CpuGemm().pack(weight)

    def gemm(x, threads):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return packed(x, bias)
        finally:
            torch.set_num_threads(before)

    batch = torch.randn(250, 589).to(dtype)  # prefill-sized: split by rows, 1-3 chunks per thread
    full = gemm(batch, 2)
    for threads in (1, 3):
        assert torch.equal(gemm(batch, threads), full), threads
    for start, rows in ((0, 1), (5, 1), (3, 6), (17, 15), (40, 60), (7, 96), (20, 97), (0, 193)):
        alone = gemm(batch[start:start + rows].contiguous(), 2)
        assert torch.equal(alone, full[start:start + rows]), (start, rows)
    if dtype == torch.float32:  # and the order is the one gemm.c states
        assert torch.equal(full[:3], _blocked_fma(batch[:3], weight, bias))


def test_the_portable_build_gives_the_same_bits():
    """The AVX2 code and the portable code do the same fused multiply-adds in the same order."""
    if not {"avx2", "fma"} <= native.cpu_flags():
        pytest.skip("no AVX2 + FMA on this CPU: both builds are the portable code")
    assert native.gemm_variant() == "avx2"
    torch.manual_seed(3)
    portable = native.build(portable=True)
    assert native.gemm_variant(portable) == "portable"
    weight, bias = torch.randn(100, 203) * 0.1, torch.randn(100)
    x = torch.randn(11, 203)
    for w, b, kernel in ((weight, bias, portable.tessera_gemm_f32),
                         (weight.bfloat16(), bias.bfloat16(), portable.tessera_gemm_bf16)):
        packed = CpuGemm().pack(w)
        x = x.to(w.dtype).float()  # the kernel takes float32 x: a bf16 model's, widened
        expected = packed(x.to(w.dtype), b)
        y = torch.empty(11, 100, dtype=w.dtype)
        kernel(x.data_ptr(), 11, 203, packed.panels.data_ptr(), b.data_ptr(), y.data_ptr(), 100, 2)
        assert torch.equal(y, expected), w.dtype


def test_bad_inputs_are_refused_before_the_kernel_reads_anything():
    gemm = CpuGemm()
    packed = gemm.pack(torch.randn(64, 32))
    assert packed(torch.randn(0, 32)).shape == (0, 64)
    for x in (torch.randn(2, 3, 32), torch.randn(2, 16), torch.randn(4, 32).half(), torch.randn(4, 32).bfloat16()):
        with pytest.raises(ValueError, match=r"the packed GEMM takes x \[rows, 32\] torch.float32"):
            packed(x)
    with pytest.raises(ValueError, match=r"bias must have shape \(64,\), got \(63,\)"):
        packed(torch.randn(4, 32), torch.randn(63))
    for weight in (torch.randn(4, 4).half(), torch.randn(2, 3, 4), torch.randn(4, 4).double()):
        with pytest.raises(ValueError, match="the C GEMM packs"):
            gemm.pack(weight)


def test_the_torch_backend_is_f_linear_bit_for_bit():
    weight, bias = torch.randn(64, 32), torch.randn(64)
    for x in (torch.randn(33, 32), torch.randn(2, 3, 32), torch.randn(1, 32), torch.randn(4, 32).half()):
        w, b = weight.to(x.dtype), bias.to(x.dtype)
        assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_attaching_packs_every_linear_and_releases_its_row_major_weight():
    torch.manual_seed(5)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(40, 24)
            self.proj = Linear(24, 24, bias=True)
            self.head = Linear(24, 40, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.proj(self.embed(ids)))

    model = Tied()
    ids = torch.tensor([1, 5, 39])
    with torch.no_grad():
        expected = model(ids)
        attach_gemm(model, CpuGemm())
        assert model.proj.gemm is not None and model.head.gemm is not None
        assert model.proj.weight.numel() == 0  # one copy of each weight: the packed one
        assert model.head.weight is model.embed.weight and model.embed.weight.shape == (40, 24)  # tied: kept
        y = model(ids)
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="packed for the cpu linear backend"):
        attach_gemm(model, None)  # the torch backend cannot run on released weights


def test_linears_sharing_a_weight_share_its_packed_copy():
    first, second = Linear(8, 20), Linear(8, 20)
    second.weight = first.weight
    model = nn.Sequential(first, second)
    attach_gemm(model, CpuGemm())
    assert first.gemm is second.gemm


def test_the_linear_backend_auto_choice_and_refusals(tiny_llama):
    decoder_dir = str(tiny_llama)
    # the AVX2 kernel where MKL would not run AVX-512 code (measured where it wins: resolve_linear_backend)
    expected = "torch" if "avx512f" in native.cpu_flags() and native.cpu_vendor() == "GenuineIntel" else "cpu"
    auto = DecoderConfig(model_dir=decoder_dir, dtype="float32")
    assert auto.linear_backend == "auto"  # building the config builds nothing; the engine resolves it at start
    assert resolve_backends(auto).linear == expected
    assert resolve_backends(auto).pointwise  # the C RMSNorm, rotary and SiLU gate with either GEMM auto picks
    bf16 = resolve_backends(DecoderConfig(model_dir=decoder_dir, dtype="bfloat16"))
    assert (bf16.linear, bf16.pointwise) == ("torch" if native.cpu_has_bf16() else "cpu", True)
    for chosen in ("torch", "cpu"):
        config = DecoderConfig(model_dir=decoder_dir, dtype="float32", linear_backend=chosen)
        assert (resolve_backends(config).linear, resolve_backends(config).pointwise) == (chosen, chosen == "cpu")
    with pytest.raises(ValueError, match="cpu linear backend computes float32 and bfloat16 only, got dtype 'float16'"):
        DecoderConfig(model_dir=decoder_dir, dtype="float16", linear_backend="cpu")
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        DecoderConfig(model_dir=decoder_dir, linear_backend="mkl")


@pytest.mark.parametrize(("vendor", "flags", "float32", "bfloat16"), [
    ("GenuineIntel", {"avx2", "fma"}, "cpu", "cpu"),                                  # AVX2 only
    ("AuthenticAMD", {"avx2", "fma"}, "cpu", "cpu"),
    ("GenuineIntel", {"avx2", "fma", "avx512f"}, "torch", "cpu"),                     # bf16 emulated by torch
    ("GenuineIntel", {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, "torch", "torch"),
    ("AuthenticAMD", {"avx2", "fma", "avx512f", "avx512_bf16"}, "cpu", "torch"),      # MKL runs AVX2 code
])
def test_the_linear_backend_auto_choice_per_cpu(monkeypatch, vendor, flags, float32, bfloat16):
    """auto: the C GEMM wherever torch's GEMM for the dtype would not run AVX-512 code (MKL's float32
    AVX-512 kernels on Intel CPUs only, oneDNN's bfloat16 ones where the CPU computes bf16)."""
    monkeypatch.setattr(native, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(native, "gemm_variant", lambda: "avx2")
    monkeypatch.setattr(native, "unavailable", lambda dtype: None)
    cpu = torch.device("cpu")
    assert resolve_linear_backend("auto", cpu, "float32") == float32
    assert resolve_linear_backend("auto", cpu, "bfloat16") == bfloat16
    assert resolve_linear_backend("torch", cpu, "float32") == "torch"
