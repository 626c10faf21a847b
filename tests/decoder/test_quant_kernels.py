"""The quantized GEMM (kernels/quant_gemm.c through services/decoder/quant.py) against the `gguf`
package: gguf's dequantize of the same bytes, then a float64 matmul, in both build variants (this
machine's and TESSERA_CPU_KERNELS=portable's).

Tolerances, stated once (quant_gemm.c's header):
    exact  |y - y64| <= 1e-5 * sum_k |x_k| |w_k|          (float32 summation error)
    fast   |y - y64| <= sum over 32-blocks b of x of (d_b / 2) * sum_{k in b} |w_k| * (1 + 1e-5)
                        + 1e-5 * sum_k |x_k| |w_k|        (d_b = max_b |x| / 127: half a step)
and fast is the float64 product with x replaced by its int8 blocks d_b * q within the exact bound.

Q8_0 / Q4_0 / Q4_1 bytes come from gguf's quantize; gguf does not quantize Q4_K / Q6_K, so their
blocks are random bytes with small finite f16 scales (any such bytes are a valid block).
"""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from services.decoder import quant
from services.decoder.kernels import native
from services.decoder.quant import BLOCK_SHAPES, GGUF_QTYPES, QuantizedWeight, quantized_variant, row_bytes

ROWS = [*range(1, 18), 23, 31, 32, 33, 36, 40]  # groups of 4 and tiles of 32, every remainder
# K: fewer blocks than a 4-block group (AVX-512's tiles), and whole groups plus a remainder
K_CASES = {"Q8_0": [96, 80, 300], "Q4_0": [96, 80, 300], "Q4_1": [64, 47, 200], "Q4_K": [256, 512, 300],
           "Q6_K": [256, 512, 300]}
CASES = [(qtype, k) for qtype, ks in K_CASES.items() for k in ks]
F16_OFFSETS = {"Q4_K": (0, 4), "Q6_K": (208, 210)}  # the bytes of a K-quant block's f16 d (and dmin)


def make_weight(qtype: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """(data uint8 [n, row_bytes], gguf's dequantize of it [n, k] float32)."""
    rng = np.random.default_rng(seed)
    ggml_type = GGMLQuantizationType[qtype]
    size, nbytes = GGML_QUANT_SIZES[ggml_type]
    blocks = -(-k // size)
    if qtype in F16_OFFSETS:
        data = rng.integers(0, 256, (n, blocks, nbytes), dtype=np.uint8)
        start, stop = F16_OFFSETS[qtype]
        scales = (rng.standard_normal((n, blocks, (stop - start) // 2)) * 0.05).astype(np.float16)
        data[..., start:stop] = scales.view(np.uint8)
        data = data.reshape(n, blocks * nbytes)
    else:
        data = quantize(rng.standard_normal((n, blocks * size)).astype(np.float32), ggml_type)
    return torch.from_numpy(np.ascontiguousarray(data)), dequantize(data, ggml_type)[:, :k]


def x_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] float32 -> (d [m, ceil(k / 32)], q [m, k]) as the fast mode quantizes it (float32
    math, roundf: half away from zero)."""
    m, k = x.shape
    padded = torch.nn.functional.pad(x, (0, -k % 32)).view(m, -1, 32)
    d = padded.abs().amax(dim=2) / 127  # [m, blocks]
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = padded * inverse[:, :, None]
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).view(m, -1)[:, :k]
    return d, q


def check(y: torch.Tensor, x: torch.Tensor, w: np.ndarray, mode: str, bias: torch.Tensor | None = None) -> None:
    x64, w64 = x.double(), torch.from_numpy(w).double()  # [m, k], [n, k]
    y64 = x64 @ w64.T + (0 if bias is None else bias.double())
    exact_bound = 1e-5 * (x64.abs() @ w64.abs().T) + 1e-30  # [m, n]
    error = (y.double() - y64).abs()
    if mode == "exact":
        assert (error <= exact_bound).all(), (error / exact_bound).max()
        return
    d, q = x_blocks(x)
    m, k = x.shape
    padded_w = torch.nn.functional.pad(w64.abs(), (0, -k % 32)).view(w64.shape[0], -1, 32).sum(dim=2)
    step_bound = (d.double() / 2) @ padded_w.T * (1 + 1e-5)  # [m, n]
    assert (error <= step_bound + exact_bound).all(), (error / (step_bound + exact_bound)).max()
    x_quantized = q.double() * d.double().repeat_interleave(32, dim=1)[:, :k]  # what fast multiplies
    assert (y.double() - (x_quantized @ w64.T + (y64 - x64 @ w64.T))).abs().max() <= (
        1e-5 * (x_quantized.abs() @ w64.abs().T)).max() + 1e-30


@pytest.fixture(scope="module")
def portable_library():
    """TESSERA_CPU_KERNELS=portable's build of quant_gemm.c alone (the whole library takes ~15 s)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "SOURCES", [source for source in native.SOURCES if source.name == "quant_gemm.c"])
        patch.setattr(native, "_SIGNATURES", {name: signature for name, signature in native._SIGNATURES.items()
                                              if name.startswith("tessera_q")})
        return native.build(portable=True)


@pytest.fixture(params=["native", "portable"])
def variant(request, monkeypatch, portable_library) -> str:
    """Which library QuantizedWeight runs: the process's own, or the portable build."""
    if request.param == "portable":
        monkeypatch.setattr(quant, "_library", lambda: portable_library)
    return request.param


@pytest.mark.parametrize("mode", quant.QUANT_MODES)
@pytest.mark.parametrize(("qtype", "k"), CASES)
def test_every_row_count_matches_the_float64_product_of_ggufs_dequantize(qtype, k, mode, variant):
    data, w = make_weight(qtype, 37, k)
    weight = QuantizedWeight(qtype, data, k, mode)
    torch.manual_seed(k)
    for m in ROWS:
        x = torch.randn(m, k)
        check(weight(x), x, w, mode)


@pytest.mark.parametrize("mode", quant.QUANT_MODES)
@pytest.mark.parametrize("qtype", GGUF_QTYPES)
def test_bias_bf16_input_threads_and_a_prefill_sized_batch(qtype, mode, variant):
    k = 300 if qtype.endswith("K") else 80
    data, w = make_weight(qtype, 130, k, seed=1)
    weight = QuantizedWeight(qtype, data, k, mode)
    torch.manual_seed(1)
    bias = torch.randn(130)
    x = torch.randn(70, k).bfloat16()
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        try:
            y = weight(x, bias)
        finally:
            torch.set_num_threads(2)
        assert y.shape == (70, 130) and y.dtype == torch.float32
        check(y, x.float(), w, mode, bias)
        check(weight(x[:9], bias), x[:9].float(), w, mode, bias)  # the kernel's tiles, not a prefill's path
    assert torch.equal(weight(x[:5], bias.bfloat16()), weight(x[:5].float(), bias.bfloat16().float()))


@pytest.mark.parametrize(("qtype", "k"), CASES)
def test_rows_and_dequantize_give_ggufs_values(qtype, k, variant):
    data, w = make_weight(qtype, 37, k, seed=2)
    weight = QuantizedWeight(qtype, data, k)
    ids = torch.tensor([36, 0, 5, 5, 17])
    assert np.array_equal(weight.rows(ids).numpy(), w[ids.numpy()])
    assert np.array_equal(weight.dequantize().numpy(), w)
    assert weight.rows(torch.tensor([], dtype=torch.int64)).shape == (0, k)


def test_the_fast_mode_quantizes_x_and_differs_from_exact():
    data, w = make_weight("Q8_0", 37, 96)
    x = torch.randn(3, 96)
    exact, fast = QuantizedWeight("Q8_0", data, 96)(x), QuantizedWeight("Q8_0", data, 96, "fast")(x)
    assert not torch.equal(exact, fast)


def test_attributes_and_the_memory_view_is_kept():
    data, _ = make_weight("Q4_0", 37, 96)
    weight = QuantizedWeight("Q4_0", data, 96, "fast")
    assert (weight.out_features, weight.in_features, weight.qtype, weight.mode) == (37, 96, "Q4_0", "fast")
    assert weight.dtype == torch.float32 and weight.nbytes == 37 * 54
    assert weight.data.data_ptr() == data.data_ptr()
    assert row_bytes("Q6_K", 300) == 420 and row_bytes("Q8_0", 80) == 102
    library = native.load()  # the Python table (read without building the kernels) is the C kernels' and ggml's
    for qtype, type_id in GGUF_QTYPES.items():
        shape = (library.tessera_qblock_size(type_id), library.tessera_qblock_bytes(type_id))
        assert BLOCK_SHAPES[qtype] == shape == GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert weight(torch.empty(0, 96)).shape == (0, 37)


def test_the_variant_follows_the_cpu_and_the_portable_switch(portable_library):
    assert portable_library.tessera_qgemm_variant().decode() == "portable"
    flags = native.cpu_flags()
    if {"avx512f", "avx512_vnni", "avx512vl"} <= flags:
        assert quantized_variant() == "avx512-vnni"
    elif not flags & {"avx2"}:
        assert quantized_variant() == "portable"


@pytest.mark.parametrize("call", [
    lambda w: w(torch.randn(2, 95)),
    lambda w: w(torch.randn(96)),
    lambda w: w(torch.randn(2, 96).double()),
    lambda w: w(torch.ones(2, 96, dtype=torch.int64)),
    lambda w: w(torch.randn(2, 96), torch.randn(36)),
    lambda w: w.rows(torch.tensor([37])),
    lambda w: w.rows(torch.tensor([-1])),
    lambda w: w.rows(torch.tensor([[0]])),
    lambda w: w.rows(torch.tensor([0.0])),
])
def test_bad_input_raises_value_error(call):
    data, _ = make_weight("Q8_0", 37, 96)
    with pytest.raises(ValueError):
        call(QuantizedWeight("Q8_0", data, 96))


@pytest.mark.parametrize("make", [
    lambda data: QuantizedWeight("Q5_0", data, 96),
    lambda data: QuantizedWeight("Q8_0", data, 96, "int8"),
    lambda data: QuantizedWeight("Q8_0", data, 95 + 32),
    lambda data: QuantizedWeight("Q8_0", data.float(), 96),
    lambda data: QuantizedWeight("Q8_0", data.view(-1), 96),
    lambda data: QuantizedWeight("Q8_0", data, 0),
])
def test_bad_construction_raises_value_error(make):
    data, _ = make_weight("Q8_0", 37, 96)
    with pytest.raises(ValueError):
        make(data)
