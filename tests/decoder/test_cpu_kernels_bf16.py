"""The C kernels in bfloat16 (attention_backend="cpu", lora_backend="cpu"), in every build variant
this machine can produce: its own (AVX512-BF16 dot products where the CPU has them), an AVX2 host's
(TESSERA_CPU_KERNELS=avx2: bf16 widened in registers) and the portable one (TESSERA_CPU_KERNELS=portable).

Tolerance, stated once: the kernels and the torch backends both sum bf16 inputs in float32 and round
the result to bf16 once, so they agree within one bf16 ulp (relative 2^-7) and mostly bit for bit;
against float64 math on the same bf16 inputs the error is the final rounding, half an ulp (2^-8
relative), plus float32 summation error (absolute 1e-5 for attention, 1e-4 for LoRA sums)."""

import shutil
import subprocess

import pytest
import torch
from test_attention import reference
from test_cpu_attention import WINDOW_AND_CAP, _case

from services.decoder.attention import cpu_backend as cpu_attention
from services.decoder.attention import make_attention_backend
from services.decoder.attention.torch_backend import paged_attention
from services.decoder.kernels import native
from services.decoder.lora.batch import LoRABatch
from services.decoder.lora.registry import make_backend

ULP = 2.0 ** -7  # bf16 keeps 8 significant bits: one ulp is at most 2^-7 of the value


@pytest.fixture(scope="module")
def portable_library():
    """The library a process builds under TESSERA_CPU_KERNELS=portable (the process's own is kept)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "_library", None)
        patch.setenv(native.VARIANT_ENV, "portable")
        return native.load()


@pytest.fixture(scope="module")
def avx2_library():
    """The library an AVX2 + FMA host without AVX-512 builds (TESSERA_CPU_KERNELS=avx2): bf16 widened
    into the AVX2 attention loops (this machine's own build takes VDPBF16PS instead, where it has it)."""
    if not {"avx2", "fma"} <= native.cpu_flags():
        pytest.fail("this x86 test machine has no AVX2 + FMA: the avx2 build cannot run here")
    return native.build(march=native.AVX2_MARCH)


@pytest.fixture(params=["built", "avx2", "portable"])
def variant(request, monkeypatch, portable_library, avx2_library) -> str:
    """Which library the cpu backends run: the process's own, an AVX2 host's, or the portable build."""
    if request.param != "built":
        monkeypatch.setattr(native, "_library", portable_library if request.param == "portable" else avx2_library)
    return native.variant()


def _bf16_case(num_heads, num_kv_heads, head_dim, block_size, lengths):
    cache, query, rows, slots, torch_meta, cpu_meta = _case(num_heads, num_kv_heads, head_dim, block_size, lengths)
    k, v = (t.to(torch.bfloat16) for t in cache.layer(0))
    return query.to(torch.bfloat16), k, v, rows, slots, torch_meta, cpu_meta


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (9, 3, 64, 16),   # SmolLM2's attention
    (8, 2, 24, 4),    # GQA 4, head_dim not a multiple of 32 (the AVX512-BF16 tail)
    (6, 3, 80, 32),
    (2, 2, 8, 1),
    (4, 2, 12, 8),    # head_dim not a multiple of 8: the V sums' scalar loops
])
@pytest.mark.parametrize("options", WINDOW_AND_CAP, ids=str)
def test_bf16_decode_rows_equal_torch_path_and_float64(variant, num_heads, num_kv_heads, head_dim, block_size,
                                                       options):
    lengths = [1, block_size + 1, 3 * block_size - 1, 37, 150]
    query, k, v, rows, slots, torch_meta, cpu_meta = _bf16_case(num_heads, num_kv_heads, head_dim, block_size,
                                                                lengths)
    scale = head_dim ** -0.5
    expected = paged_attention(query, k, v, torch_meta, scale, **options)
    got = make_attention_backend("cpu").forward(query, k, v, cpu_meta, scale, **options)
    assert got.dtype == torch.bfloat16
    for i in range(5):  # prefill rows (positions 5..9 of slots 20..29): the C prefill kernel, float32 sums rounded once
        exact = reference(query[i], k, v, torch.arange(20, 26 + i), scale, **options)
        torch.testing.assert_close(got[i].double(), exact, rtol=ULP / 2, atol=1e-5)
        torch.testing.assert_close(got[i].float(), expected[i].float(), rtol=2 * ULP, atol=4e-3)  # SDPA rounds P to bf16
    decode = torch.tensor(rows)
    torch.testing.assert_close(got[decode].float(), expected[decode].float(), rtol=ULP, atol=1e-5)
    assert (got[decode] == expected[decode]).float().mean() > 0.9  # the same float32 math, rounded once
    for row, row_slots in zip(rows, slots):
        torch.testing.assert_close(got[row].double(), reference(query[row], k, v, row_slots, scale, **options),
                                   rtol=ULP / 2, atol=1e-5)


def test_bf16_attention_is_bf16_rounding_away_from_float32(variant):
    """The whole bf16 path (bf16 query and cache) against the float32 kernel on the unrounded inputs."""
    cache, query, rows, _, _, cpu_meta = _case(9, 3, 64, 16, [40, 200, 333])
    k, v = cache.layer(0)
    backend = make_attention_backend("cpu")
    full = backend.forward(query, k, v, cpu_meta, 0.125)
    half = backend.forward(query.bfloat16(), k.bfloat16(), v.bfloat16(), cpu_meta, 0.125)
    decode = torch.tensor(rows)
    error = (half[decode].float() - full[decode]).abs()
    assert error.max() < 0.02 and error.mean() < 2e-3  # inputs and output each rounded to 8 bits


def test_bf16_stale_non_finite_slots_are_never_read(variant):
    query, k, v, rows, _, _, cpu_meta = _bf16_case(4, 2, 16, 4, [5, 9])
    clean = make_attention_backend("cpu").forward(query, k, v, cpu_meta, 0.25)
    used = {int(b) for b in cpu_meta.decode.block_tables.flatten()}
    for block in set(range(k.shape[1] // 4)) - used:
        k[:, 4 * block:4 * block + 4], v[:, 4 * block:4 * block + 4] = float("nan"), float("inf")
    got = make_attention_backend("cpu").forward(query, k, v, cpu_meta, 0.25)
    assert torch.equal(got[torch.tensor(rows)], clean[torch.tensor(rows)])


def test_mixed_dtypes_are_refused():
    query, k, v, _, _, _, cpu_meta = _bf16_case(4, 2, 16, 4, [3, 9])
    # a float32 query over bf16 caches writes a float32 output (--kv-cache-dtype bfloat16), not a bf16 one
    with pytest.raises(ValueError, match="got query torch.float32, caches torch.bfloat16/torch.bfloat16, output "
                                         "torch.bfloat16"):
        cpu_attention.paged_decode_attention(query.float(), k, v, cpu_meta.decode, 4, 0.25, torch.empty_like(query))
    with pytest.raises(ValueError, match="all float32, all bfloat16, or a float32 query over bfloat16 caches"):
        cpu_attention.paged_decode_attention(query.half(), k.half(), v.half(), cpu_meta.decode, 4, 0.25,
                                             query.half())
    y = torch.zeros(4, 5, dtype=torch.bfloat16)
    batch = LoRABatch.build(torch.tensor([0, 0, -1, 0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        make_backend("cpu").add_lora(y, torch.randn(4, 8), torch.randn(1, 2, 8).bfloat16(),
                                     torch.randn(1, 5, 2).bfloat16(), batch)
    assert not y.any()


@pytest.mark.parametrize("index", range(5))
def test_bf16_lora_equals_torch_backend_and_float64(variant, index):
    """The Triton cases' odd sizes (ranks 1..64 padded, slot -1 mixed in), every tensor bf16."""
    from lora_kernel_cases import CASES, make_case, reference

    x, y0, a, b, slots, decode = (t.to(torch.bfloat16) if t.is_floating_point() else t
                                  for t in make_case(index, *CASES[index]))
    b = b.transpose(1, 2).contiguous().transpose(1, 2)  # the bank's layout
    batch = LoRABatch.build(slots, decode)
    expected, got = y0.clone(), y0.clone()
    make_backend("torch").add_lora(expected, x, a, b, batch)
    make_backend("cpu").add_lora(got, x, a, b, batch)
    torch.testing.assert_close(got.float(), expected.float(), rtol=ULP, atol=1e-4)
    assert (got == expected).float().mean() > 0.9  # the same float32 math, rounded once
    torch.testing.assert_close(got.double(), reference(x, y0, a, b, slots), rtol=ULP / 2, atol=1e-4)
    base = slots == -1
    assert torch.equal(got[base], y0[base])
    rows = batch.decode_rows[slots[batch.decode_rows] >= 0]  # the kernel's rows (the others: torch backend)
    assert not torch.equal(got[rows], y0[rows]) or not rows.numel()  # corrections applied


def test_bf16_lora_thread_count_invariant_at_smollm_sizes(variant):
    torch.manual_seed(7)
    x, y0 = torch.randn(32, 576).bfloat16(), torch.randn(32, 1536).bfloat16()
    a = (torch.randn(8, 16, 576) / 24).bfloat16()
    b = torch.randn(8, 16, 1536).bfloat16().transpose(1, 2)
    batch = LoRABatch.build(torch.arange(32) % 9 - 1, torch.arange(32))
    outs, threads = [], torch.get_num_threads()
    for n in (threads, 1):
        torch.set_num_threads(n)
        try:
            y = y0.clone()
            make_backend("cpu").add_lora(y, x, a, b, batch)
            outs.append(y)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_the_variant_follows_the_cpu_and_the_portable_switch(portable_library):
    assert native.variant(portable_library) == "portable"
    if "avx512_bf16" not in native.cpu_flags():
        assert native.variant() == "portable"  # never code this CPU cannot run


def _objdump(tmp_path, *flags) -> str:
    compiler = shutil.which("cc")
    if compiler is None or shutil.which("objdump") is None:
        pytest.skip("needs cc and objdump")
    out = tmp_path / "kernels.o"
    source = native.SOURCES[0]
    done = subprocess.run([compiler, "-O1", "-fopenmp", "-c", *flags, str(source), "-o", str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0 and "avx512bf16" in done.stderr:
        pytest.skip(f"this compiler has no AVX512-BF16: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr
    return subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True, check=True).stdout


def test_the_avx512_bf16_variant_compiles_to_vdpbf16ps_and_the_portable_one_does_not(tmp_path):
    """Built for an AVX512-BF16 target whatever this CPU is (compiled, not run)."""
    avx512 = ["-mavx512f", "-mavx512bw", "-mavx512bf16"]
    assert "vdpbf16ps" in _objdump(tmp_path, *avx512)
    assert "vdpbf16ps" not in _objdump(tmp_path, *avx512, "-DTESSERA_PORTABLE")


def test_the_avx2_variant_holds_avx2_code_and_no_avx512(tmp_path):
    """TESSERA_CPU_KERNELS=avx2's target: 256-bit AVX2 code, no 512-bit register, no VDPBF16PS (an
    AVX2 host would fault on them), whatever this CPU is (compiled, not run)."""
    code = _objdump(tmp_path, f"-march={native.AVX2_MARCH}")
    assert "ymm" in code and "vfmadd" in code
    assert "zmm" not in code and "vdpbf16ps" not in code
