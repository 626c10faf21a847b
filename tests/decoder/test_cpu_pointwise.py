"""The C RMSNorm, rotary and SiLU-gate kernels (kernels/norm_rope.c, the cpu linear backend's) against
the torch code they replace: rotary bit for bit (float32 and bfloat16, on the column views of a fused
q/k/v projection), RMSNorm against float64 and, in bfloat16, transformers' rounding order, the SiLU
gate against torch's `silu(gate) * up` and float64. Also: a row does
not depend on the thread count, and bad inputs are refused before the kernel reads them. The whole
engine on this backend is checked against transformers in test_smollm.py and test_conformance.py."""

import pytest
import torch

from services.decoder.kernels.pointwise import CpuPointwise
from services.decoder.model_llama import RMSNorm
from services.decoder.rotary import RotaryEmbedding, apply_rotary

BF16_ULP = 2.0 ** -7  # bfloat16's spacing relative to the value (8 bits of significand)


@pytest.fixture(scope="module")
def pointwise():
    return CpuPointwise()


def _qkv(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """q and k as the attention module has them: column views of one [tokens, (heads + 2 kv) d] output."""
    gen = torch.Generator().manual_seed(seed)
    fused = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    q = fused[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = fused[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [
    (1, 9, 3, 64),     # SmolLM2, one decode row
    (37, 9, 3, 64),
    (600, 9, 3, 64),   # a prefill chunk: the parallel loop
    (5, 4, 2, 128),
    (3, 2, 1, 6),      # head_dim not a multiple of the vector width
    (0, 9, 3, 64),
])
def test_rotary_is_the_torch_expression_bit_for_bit(pointwise, dtype, tokens, heads, kv_heads, head_dim):
    q, k = _qkv(tokens, heads, kv_heads, head_dim, dtype)
    positions = torch.arange(tokens) * 97 + 5  # large angles too
    cos, sin = RotaryEmbedding(head_dim, 10000.0).cos_sin(positions, dtype)
    for x in (q, k):
        got = pointwise.rotary(x, cos, sin)
        assert got.is_contiguous() and got.dtype == dtype
        assert torch.equal(got, apply_rotary(x, cos, sin))


def test_rotary_m_rope_tables(pointwise):
    """M-RoPE (Qwen2-VL) only changes the tables: the kernel applies them as given."""
    q, _ = _qkv(11, 4, 2, 16, torch.float32)
    positions = torch.stack([torch.arange(11), torch.arange(11) % 3, torch.arange(11) // 3])
    cos, sin = RotaryEmbedding(16, 10000.0, (2, 3, 3)).cos_sin(positions, torch.float32)
    assert torch.equal(pointwise.rotary(q, cos, sin), apply_rotary(q, cos, sin))


def _norm(hidden, dtype, seed=1):
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return norm.to(dtype)


@pytest.mark.parametrize("rows", [1, 7, 600])
def test_rms_norm_float32_against_float64(pointwise, rows):
    norm = _norm(576, torch.float32)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 5
    got = pointwise.rms_norm(x, norm.weight, norm.eps)
    x64 = x.double()
    expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, norm(x), rtol=1e-6, atol=1e-6)  # the torch path it replaces


@pytest.mark.parametrize("rows", [1, 7, 600])
def test_rms_norm_bfloat16_rounds_as_transformers(pointwise, rows):
    """Normalize in float32, round to bf16, scale in bf16: only the sum of squares' order differs
    from the torch path, so at most a rare one-ulp difference where a value lies on a rounding edge."""
    norm = _norm(576, torch.bfloat16)
    x = (torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 5).to(torch.bfloat16)
    got, expected = pointwise.rms_norm(x, norm.weight, norm.eps), norm(x)
    assert got.dtype == torch.bfloat16
    assert (got == expected).float().mean() >= 0.999
    torch.testing.assert_close(got.float(), expected.float(), rtol=BF16_ULP, atol=0)


def test_rms_norm_per_head_on_a_column_view(pointwise):
    """Qwen3's q/k norm: RMSNorm(head_dim) over each head of a column view."""
    q, _ = _qkv(13, 4, 2, 32, torch.float32)
    norm = _norm(32, torch.float32)
    torch.testing.assert_close(pointwise.rms_norm(q, norm.weight, norm.eps), norm(q), rtol=1e-6, atol=1e-6)


def _gate_up(rows, inter, dtype, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)


def _torch_silu_mul(gate_up):
    """LlamaMLP's torch path (transformers' act_fn(gate_proj(x)) * up_proj(x))."""
    gate, up = gate_up.split(gate_up.shape[1] // 2, -1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("rows, inter", [(1, 1536), (19, 1536), (600, 1536), (3, 5), (0, 64)])
def test_silu_mul_float32_within_ulps_of_torch_and_float64(pointwise, rows, inter):
    """float32: torch's formula with glibc's vector expf for torch's own exp, so results may differ
    from torch's by a few units in the last place; against float64 about as close as torch is."""
    gate_up = _gate_up(rows, inter, torch.float32)
    got, expected = pointwise.silu_mul(gate_up), _torch_silu_mul(gate_up)
    assert got.shape == (rows, inter) and got.is_contiguous() and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=0, rtol=5e-7)
    gate, up = gate_up.double().split(inter, -1)
    exact = gate * torch.sigmoid(gate) * up
    if rows:
        assert ((got.double() - exact).abs() / exact.abs()).max() < 4e-7  # torch's own: 1.8e-7 here


@pytest.mark.parametrize("rows", [1, 19, 600])
def test_silu_mul_bfloat16_rounds_as_torch(pointwise, rows):
    """bf16: silu rounded to bf16, then the product rounded (torch's two ops); a float32 silu that
    differs from torch's in its last bits moves a result by at most one bf16 step, and rarely."""
    gate_up = _gate_up(rows, 1536, torch.bfloat16)
    got, expected = pointwise.silu_mul(gate_up), _torch_silu_mul(gate_up)
    assert got.dtype == torch.bfloat16 and got.is_contiguous()
    assert (got == expected).double().mean() > 0.999
    torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=2 * BF16_ULP)


def test_silu_mul_views_and_extremes(pointwise):
    """A row-strided view (gate_up columns of a wider output) and gates far out: -100 (exp(100)
    overflows: -0), 100, +-inf and NaN, as torch computes them."""
    wide = _gate_up(7, 24, torch.float32)
    view = wide[:, 8:40]  # rows 48 apart, 32 contiguous columns each
    torch.testing.assert_close(pointwise.silu_mul(view), _torch_silu_mul(view), atol=0, rtol=5e-7)
    gate = torch.tensor([[-100.0, 100.0, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 88.0, -88.0]])
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)], 1)
    got, expected = pointwise.silu_mul(gate_up), _torch_silu_mul(gate_up)
    assert torch.equal(got.isnan(), expected.isnan())
    finite = ~expected.isnan()
    torch.testing.assert_close(got[finite], expected[finite], atol=0, rtol=5e-7)
    assert torch.equal(got[finite].signbit(), expected[finite].signbit())


def test_mlp_runs_the_c_gate_once_attached(pointwise):
    """LlamaMLP with `pointwise` set gives the torch path's output (up to float32 rounding)."""
    from services.decoder.kernels.pointwise import attach_pointwise
    from services.decoder.model_llama import LlamaMLP, LlamaSpec

    spec = LlamaSpec.from_config({"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
                                  "rms_norm_eps": 1e-6, "max_position_embeddings": 64})
    mlp = LlamaMLP(spec, 0)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(3))
    x = torch.randn(5, 32)
    with torch.inference_mode():  # as the engine runs it
        expected = mlp(x)
        attach_pointwise(mlp, pointwise)
        assert mlp.pointwise is pointwise
        torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)


def test_rows_do_not_depend_on_the_thread_count(pointwise):
    q, _ = _qkv(600, 9, 3, 64, torch.bfloat16)
    cos, sin = RotaryEmbedding(64, 10000.0).cos_sin(torch.arange(600), torch.bfloat16)
    x = q.reshape(600, -1).contiguous()
    norm = _norm(576, torch.bfloat16)
    both = pointwise.rms_norm(x, norm.weight, norm.eps), pointwise.rotary(q, cos, sin)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pointwise.rms_norm(x, norm.weight, norm.eps), pointwise.rotary(q, cos, sin)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], both[0]) and torch.equal(one[1], both[1])
    assert torch.equal(pointwise.rms_norm(x[5:6], norm.weight, norm.eps), both[0][5:6])  # a row alone
    gate_up = _gate_up(600, 1536, torch.float32)
    both = pointwise.silu_mul(gate_up)
    try:
        torch.set_num_threads(1)
        one = pointwise.silu_mul(gate_up)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, both) and torch.equal(pointwise.silu_mul(gate_up[7:8]), both[7:8])


def test_bad_inputs_are_refused(pointwise):
    q, _ = _qkv(4, 2, 1, 8, torch.float32)
    cos, sin = RotaryEmbedding(8, 10000.0).cos_sin(torch.arange(4), torch.float32)
    with pytest.raises(ValueError, match="one dtype"):
        pointwise.rotary(q, cos.bfloat16(), sin)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pointwise.rotary(q.double(), cos.double(), sin.double())
    with pytest.raises(ValueError, match=r"cos/sin \[tokens, head_dim\]"):
        pointwise.rotary(q, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="head_dim even"):
        pointwise.rotary(torch.zeros(4, 2, 7), torch.zeros(4, 7), torch.zeros(4, 7))
    x, weight = torch.zeros(3, 16), torch.ones(16)
    with pytest.raises(ValueError, match=r"weight must be \[16\]"):
        pointwise.rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        pointwise.rms_norm(x, weight.bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pointwise.rms_norm(x.half(), weight.half(), 1e-6)
    with pytest.raises(ValueError, match="0-dim"):
        pointwise.rms_norm(torch.tensor(1.0), torch.ones(1), 1e-6)
    with pytest.raises(ValueError, match="on meta"):
        pointwise.rotary(q.to("meta"), cos, sin)
    with pytest.raises(ValueError, match=r"gate_up \[rows, 2 \* intermediate\], got \(3, 5\)"):
        pointwise.silu_mul(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"got \(6,\)"):
        pointwise.silu_mul(torch.zeros(6))
    with pytest.raises(ValueError, match="torch.float16 on cpu"):
        pointwise.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
