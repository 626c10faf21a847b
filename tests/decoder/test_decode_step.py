"""The fused decode step (services/decoder/decode_step.py, kernels/decode_step.c) against transformers,
PEFT and a float64 GEMV, with proof that the fused call ran (not the module path beside it)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from decoder_testing import make_tiny_llama
from family_conformance import LORA_TARGETS, PROMPTS, check_lora, check_regime, references

from services.decoder.config import DecoderConfig
from services.decoder.decode_step import MAX_ROWS, ROW_MAJOR_MAX_ROWS, FusedDecode, row_major_max_rows
from services.decoder.engine import start_engine
from services.decoder.kernels import native

FAMILIES = {  # family -> make_tiny_llama overrides: q/k/v bias (qwen2), q/k norm (qwen3), a window (mistral)
    "llama": {},
    "llama-head128": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128),
    "qwen2": {},
    "qwen3": {},
    "mistral": dict(sliding_window=24),
}


@pytest.fixture
def fused_calls(monkeypatch) -> list[tuple[int, bool]]:
    """(rows, whether adapter rows were in the step) of every fused decode call while the test runs."""
    calls, call = [], FusedDecode._run

    def counting(self, x, meta):
        calls.append((x.shape[0], self._lora is not None and self._lora.batch is not None))
        return call(self, x, meta)

    monkeypatch.setattr(FusedDecode, "_run", counting)
    return calls


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    out = {}
    for name, overrides in FAMILIES.items():
        path = make_tiny_llama(tmp_path_factory.mktemp(name), seed=3, family=name.split("-")[0], **overrides)
        out[name] = (path, references(path, PROMPTS))
    return out


@pytest.mark.parametrize("linear", ["torch", "cpu"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_step_equals_transformers(models, family, linear, fused_calls):
    """Greedy ids for 64 tokens = transformers and fp32 logits within 1e-4, alone and 5 concurrent,
    the decode steps through the fused call (packed weights: up to 32 rows; row-major float32: up to 16)."""
    path, refs = models[family]
    for regime in ("alone", "concurrent"):
        check_regime(path, refs, regime, PROMPTS, linear_backend=linear, decode_step="fused")
    rows = [r for r, _ in fused_calls]
    assert rows.count(1) >= 60, "the lone request's decode steps were meant to be fused"
    assert len(PROMPTS) <= ROW_MAJOR_MAX_ROWS[torch.float32]
    assert max(rows) == len(PROMPTS), "the concurrent decode steps were meant to be fused"


@pytest.mark.parametrize("targets", list(LORA_TARGETS))
def test_fused_step_lora_equals_peft(tmp_path, targets, fused_calls):
    """Two PEFT adapters and base rows in one batch = PEFT, their BGMV inside the fused call."""
    path = make_tiny_llama(tmp_path / "m", seed=5, family="qwen2")
    check_lora(path, LORA_TARGETS[targets], linear_backend="cpu", decode_step="fused")
    assert any(with_adapters for _, with_adapters in fused_calls), "adapter rows were meant to decode fused"


def test_lora_dtype_bfloat16_on_a_float32_model_equals_peft_with_rounded_factors(tmp_path, fused_calls):
    """--lora-dtype bfloat16: the slots hold bfloat16 factors (half the bytes BGMV reads) and the
    result is PEFT's with its factors rounded to bfloat16, decode rows through the fused call's mixed
    kernel; a triton backend or a bfloat16 model's float32 factors are refused."""
    path = make_tiny_llama(tmp_path / "m", seed=6, family="qwen2")
    check_lora(path, LORA_TARGETS["all-linear"], factor_dtype=torch.bfloat16, lora_dtype="bfloat16",
               linear_backend="cpu", decode_step="fused")
    assert any(with_adapters for _, with_adapters in fused_calls), "adapter rows were meant to decode fused"
    config = DecoderConfig(model_dir=str(path), lora_dtype="bfloat16", num_blocks=16)
    assert config.lora_torch_dtype == torch.bfloat16
    assert DecoderConfig(model_dir=str(path), num_blocks=16).lora_torch_dtype == torch.float32
    with pytest.raises(ValueError, match="lora_dtype 'float32' does not fit dtype 'bfloat16'"):
        DecoderConfig(model_dir=str(path), dtype="bfloat16", lora_dtype="float32")
    with pytest.raises(ValueError, match="triton LoRA backend computes factors of the model's dtype"):
        DecoderConfig(model_dir=str(path), dtype="float32", lora_dtype="bfloat16", lora_backend="triton")


@pytest.mark.parametrize("linear", ["cpu", "torch"])
def test_fused_step_bf16_equals_module_path(models, linear, fused_calls):
    """bfloat16: the fused call and the module path give the same greedy ids (the same kernels and
    roundings; only each projection's order of summation differs), on packed weights and on row-major
    ones (the GEMV: 12 concurrent requests, so steps past 8 rows fuse where the CPU has no AMX)."""
    import random

    path, _ = models["qwen3"]
    rng = random.Random(4)
    prompts = PROMPTS[:3] + [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 30))] for _ in range(9)]
    outputs = {}
    for step in ("fused", "modules"):
        engine = start_engine(DecoderConfig(model_dir=str(path), dtype="bfloat16", max_model_len=256, num_blocks=128,
                                            linear_backend=linear, decode_step=step))
        try:
            outputs[step] = _generate(engine, prompts, 32)
        finally:
            engine.shutdown()
    rows = [r for r, _ in fused_calls]
    assert rows, "the bf16 decode steps were meant to be fused"
    limit = MAX_ROWS if linear == "cpu" else row_major_max_rows(torch.bfloat16, native.cpu_flags())
    assert max(rows) == min(len(prompts), limit), "the concurrent decode steps were meant to be fused"
    assert outputs["fused"] == outputs["modules"]


def test_gathered_inputs_equal_the_module_lookups(models, monkeypatch):
    """The fused step's own lookups (run_ids: the embedding row and the RoPE table's cos/sin rows copied
    in C) give the logits, bit for bit, of the step fed by torch's embedding and cos_sin, alone and
    concurrent; an id outside the embedding or a position outside the table is refused, not read."""
    from decoder_testing import capture_logits

    from services.decoder.attention.cpu_backend import CpuAttentionMetadata, decode_metadata

    path, _ = models["llama"]
    gathered, logits = [], {}
    run_ids, gather_from = FusedDecode.run_ids, FusedDecode._gather_from
    monkeypatch.setattr(FusedDecode, "run_ids", lambda self, *a: (gathered.append(a[0].shape[0]), run_ids(self, *a))[1])
    for gathers in (True, False):
        monkeypatch.setattr(FusedDecode, "_gather_from", gather_from if gathers else lambda self, model: False)
        engine = start_engine(DecoderConfig(model_dir=str(path), max_model_len=256, num_blocks=64,
                                            linear_backend="cpu", decode_step="fused"))
        try:
            rows = capture_logits(engine)
            _generate(engine, PROMPTS, 24)
            _generate(engine, PROMPTS[:1], 24)
            logits[gathers] = rows
            fused = engine.parts.runner.model.fused_decode
            assert fused.gathers == gathers
            if gathers:
                meta = CpuAttentionMetadata(slot_mapping=torch.tensor([0]), decode=decode_metadata([0], [[0]], [1], 16))
                for ids, positions in (([fused._step.vocab], [0]), ([-1], [0]), ([3], [256])):
                    with pytest.raises(RuntimeError, match="outside the"):
                        fused.run_ids(torch.tensor(ids), torch.tensor(positions), meta)
                for ids, positions in ((torch.tensor([3], dtype=torch.int32), torch.tensor([0])),
                                       (torch.tensor([3]), torch.tensor([0, 1]))):
                    with pytest.raises(ValueError, match="int64 ids and positions"):
                        fused.run_ids(ids, positions, meta)
        finally:
            engine.shutdown()
    assert gathered.count(1) >= 20 and max(gathered) == len(PROMPTS)
    given = list(logits[False].values())  # by request (the ids differ between the runs: matched by their logits)
    assert len(logits[True]) == len(given) == len(PROMPTS) + 1
    for rows in logits[True].values():
        same = [i for i, other in enumerate(given) if len(other) == len(rows) and all(map(torch.equal, rows, other))]
        assert same, "a request's logits differ between the gathered and the given inputs"
        del given[same[0]]


def test_row_major_rows_per_cpu():
    """The GEMV's row limit over row-major weights follows torch's GEMM on the CPU: bfloat16 to 8 rows
    where oneDNN has AMX tiles, every fused row count (32) where it has AVX512-BF16 only (or less);
    float32 16 either way."""
    amx = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    no_amx = frozenset({"avx2", "avx512f", "avx512_bf16"})
    assert row_major_max_rows(torch.bfloat16, amx) == 8
    assert row_major_max_rows(torch.bfloat16, no_amx) == MAX_ROWS == 32
    assert row_major_max_rows(torch.float32, amx) == row_major_max_rows(torch.float32, no_amx) == 16


def _generate(engine, prompts, max_tokens):
    import asyncio

    from services.decoder.types import GenerateInput, SamplingParams

    async def one(prompt):
        ids = []
        request = GenerateInput(SamplingParams(max_tokens=max_tokens), prompt_token_ids=tuple(prompt))
        async for out in engine.generate(request):
            ids += out.token_ids
        return ids

    async def run():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(run())


def test_decode_step_choice(models, tmp_path):
    """auto resolves to fused where it runs and says so in DecoderInfo; fused is refused, naming the
    reason, on the torch attention backend and for a family whose blocks differ (Gemma)."""
    path, _ = models["llama"]
    engine = start_engine(DecoderConfig(model_dir=str(path), max_model_len=128, num_blocks=16,
                                        attention_backend="cpu"))
    try:
        assert engine.info().decode_step == "fused"
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="--decode-step fused cannot run here: it needs the cpu attention backend"):
        start_engine(DecoderConfig(model_dir=str(path), max_model_len=128, num_blocks=16, attention_backend="torch",
                                   decode_step="fused"))
    gemma = make_tiny_llama(tmp_path / "gemma", family="gemma2", head_dim=16)
    with pytest.raises(ValueError, match="blocks differ from Llama's"):
        start_engine(DecoderConfig(model_dir=str(gemma), max_model_len=128, num_blocks=16, decode_step="fused"))
    engine = start_engine(DecoderConfig(model_dir=str(gemma), max_model_len=128, num_blocks=16))
    try:
        assert engine.info().decode_step == "modules"
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="decode_step must be one of"):
        DecoderConfig(model_dir=str(path), decode_step="fast")


def _gemv(library, x, w, b):
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    kernel = library.tessera_gemv_f32 if x.dtype == torch.float32 else library.tessera_gemv_bf16
    kernel(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
           w.shape[0], 2)
    return y


@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def library(request):
    """The kernel library as this machine builds it (AVX-512 / AVX512-BF16 where it has them), as an
    AVX2 + FMA host without AVX-512 builds it (the GEMV's vectorized loop, bf16 widened) and portable."""
    if request.param == "avx2":
        if not {"avx2", "fma"} <= native.cpu_flags():
            pytest.fail("this x86 test machine has no AVX2 + FMA: the avx2 build cannot run here")
        return native.build(march=native.AVX2_MARCH)
    return native.load() if request.param == "native" else native.build(portable=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_float64(library, dtype):
    """Odd shapes (K not a multiple of the vector width, M = 1..40, N not a multiple of the threads'
    split), with and without bias: within float32 summation error of float64 (bf16: of the rounded
    result); a row's result does not depend on the batch around it, nor an output's on the outputs
    computed with it (the bf16 loops' tiles of four or eight W rows)."""
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 1, 1), (1, 15, 7), (1, 100, 19), (1, 576, 40), (2, 17, 33), (3, 33, 5), (4, 100, 19),
                    (5, 576, 31), (8, 70, 13), (9, 33, 17), (13, 47, 9), (6, 70, 10), (32, 1536, 17), (40, 64, 3)):
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        for bias in (None, torch.randn(n, generator=gen).to(dtype)):
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            y = _gemv(library, x, w, bias)
            scale = x.double().abs() @ w.double().abs().T + 1
            tolerance = 1e-6 if dtype == torch.float32 else 8e-3
            assert ((y.double() - exact).abs() / scale).max() < tolerance, (m, k, n, dtype)
            assert torch.equal(_gemv(library, x[-1:].contiguous(), w, bias)[0], y[-1]), "a row depends on its batch"
            last = _gemv(library, x, w[-1:].contiguous(), None if bias is None else bias[-1:].contiguous())
            assert torch.equal(last[:, 0], y[:, -1]), "an output depends on its neighbours"


def test_panel_gemv_gives_the_packed_gemm_bits(library):
    """The fused step's float32 projection over packed panels at 1-4 rows (AVX-512: its own stream,
    elsewhere gemm.c's GEMM) gives gemm.c's bits at odd shapes (K across its 128-k blocks and not a
    multiple of the vector width, N not a multiple of 16), with and without bias, within float32
    summation error of float64; 5 rows take the GEMM."""
    from services.decoder.linear import CpuGemm

    gen = torch.Generator().manual_seed(1)
    for m, k, n in ((1, 1, 1), (1, 15, 7), (2, 131, 33), (3, 300, 50), (4, 576, 37), (4, 1537, 16), (5, 200, 20)):
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        panels = CpuGemm().pack(w).panels
        for bias in (None, torch.randn(n, generator=gen)):
            ys = []
            for kernel in (library.tessera_panel_gemv_f32, library.tessera_gemm_f32):
                y = torch.full((m, n), float("nan"))
                kernel(x.data_ptr(), m, k, panels.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                       n, 2)
                ys.append(y)
            assert torch.equal(ys[0], ys[1]), (m, k, n)
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            scale = x.double().abs() @ w.double().abs().T + 1
            assert ((ys[0].double() - exact).abs() / scale).max() < 1e-6, (m, k, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_logits_equal_norm_then_head(library, dtype):
    """The final norm, head and float32 widening in one call (FusedDecode.logits) give the bits of the
    C RMSNorm then the head's kernel (the GEMV over a row-major head; over a packed one gemm.c's GEMM,
    whose bits panel_gemv gives) then `.float()`, within rounding of torch's RMSNorm and linear; a row
    whose float32 statistic sum(x^2) / hidden overflows (finite |x| ~ 1e20) or is NaN is NaN throughout
    and not finite; a row with a non-finite logit keeps its values and is not finite; at 1..8 rows and
    odd sizes (hidden 37, vocab 53)."""
    from services.decoder.decode_step import Projection
    from services.decoder.linear import CpuGemm
    from services.decoder.model_llama import RMSNorm

    gen = torch.Generator().manual_seed(2)
    hidden, vocab, eps = 37, 53, 1e-6
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    head = torch.randn(vocab, hidden, generator=gen).to(dtype)
    loud_head = head.clone()
    loud_head[7] = 3e38  # the head's column 7: inf or NaN (inf - inf) for every row
    norm = RMSNorm(hidden, eps).to(dtype)
    norm.weight.data.copy_(weight)
    f32 = dtype == torch.float32
    kernel = library.tessera_decode_logits_f32 if f32 else library.tessera_decode_logits_bf16
    rms = library.tessera_rms_norm_f32 if f32 else library.tessera_rms_norm_bf16
    gemm = library.tessera_gemm_f32 if f32 else library.tessera_gemm_bf16
    for rows in range(1, 9):
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        if rows >= 3:
            x[1] = 1e20  # finite, but its sum of squares is not
            x[2, 5] = float("nan")
        expected_normed = torch.empty(rows, hidden, dtype=dtype)
        rms(x.data_ptr(), weight.data_ptr(), expected_normed.data_ptr(), rows, hidden, eps, 1)
        overflow = ~torch.isfinite(x.float().pow(2).mean(-1))
        for w in (head, loud_head):
            panels = CpuGemm().pack(w).panels
            for packed in (0, 1):
                projection = Projection((panels if packed else w).data_ptr(), None, packed, hidden, vocab)
                logits = torch.full((rows, vocab), -1.0)
                finite = torch.full((rows,), 7, dtype=torch.uint8)
                greedy = torch.full((rows,), -7, dtype=torch.long)
                normed = torch.empty(rows, hidden, dtype=dtype)
                head_out, widened = torch.empty(rows, vocab, dtype=dtype), torch.empty(rows, hidden)
                extra = [] if f32 else [head_out.data_ptr()]
                kernel(ctypes.byref(projection), x.data_ptr(), rows, weight.data_ptr(), eps, normed.data_ptr(), *extra,
                       logits.data_ptr(), finite.data_ptr(), greedy.data_ptr(),
                       *([] if f32 else [widened.data_ptr()]), 2)
                assert greedy.tolist() == [int(logits[r].argmax()) if finite[r] else -1 for r in range(rows)]

                if packed:
                    expected = torch.empty(rows, vocab, dtype=dtype)
                    x_in = expected_normed.float()  # gemm.c takes float32 rows (a bf16 x widened exactly)
                    gemm(x_in.data_ptr(), rows, hidden, panels.data_ptr(), None, expected.data_ptr(), vocab, 2)
                    expected = expected.float()
                else:
                    expected = _gemv(library, expected_normed, w, None).float()
                expected[overflow] = float("nan")
                assert torch.equal(logits.isnan(), expected.isnan()), (rows, dtype, packed)
                assert torch.equal(logits.nan_to_num(), expected.nan_to_num()), (rows, dtype, packed)
                assert finite.tolist() == torch.isfinite(expected).all(-1).to(torch.uint8).tolist()
                if rows >= 3:
                    assert overflow[1] and overflow[2] and not overflow[0]
                if w is loud_head:
                    assert not finite.any() and not torch.isfinite(logits[0, 7]) and torch.isfinite(logits[0, :7]).all()
                    continue
                ok = ~overflow
                torch_logits = torch.nn.functional.linear(norm(x[ok]), w).float()
                tolerance = 1e-5 if f32 else 5e-2
                torch.testing.assert_close(logits[ok], torch_logits, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_logits_greedy_is_the_first_of_equal_maxima(library, dtype):
    """The logits call's greedy token is torch.max(dim=-1)'s index: the first of equal largest logits,
    wherever they sit (one vector lane, two lanes, the vector part and the scalar tail), at vocab
    sizes with and without a tail (tied logits come from duplicated head rows: the same dot product)."""
    from services.decoder.decode_step import Projection

    gen = torch.Generator().manual_seed(3)
    hidden = 24
    f32 = dtype == torch.float32
    kernel = library.tessera_decode_logits_f32 if f32 else library.tessera_decode_logits_bf16
    weight = torch.ones(hidden, dtype=dtype)
    for vocab in (7, 16, 1000, 1003):
        x = torch.randn(2, hidden, generator=gen).to(dtype)
        base = torch.randn(vocab, hidden, generator=gen).to(dtype)
        cases = [base, torch.zeros(vocab, hidden, dtype=dtype)]  # every logit tied: token 0
        for first, second in ((3, 5), (2, 18), (1, vocab - 1), (vocab - 2, vocab - 1), (0, vocab // 2)):
            if second >= vocab or first >= second:
                continue
            head = base.clone()
            head[first] = head[second] = base[0] * 0 + x[0] * 8  # the largest logit of row 0, twice
            cases.append(head)
        for head in cases:
            logits = torch.empty(2, vocab)
            finite, greedy = torch.empty(2, dtype=torch.uint8), torch.full((2,), -7, dtype=torch.long)
            normed, head_out, widened = torch.empty(2, hidden, dtype=dtype), torch.empty(2, vocab, dtype=dtype), \
                torch.empty(2, hidden)
            kernel(ctypes.byref(Projection(head.data_ptr(), None, 0, hidden, vocab)), x.data_ptr(), 2,
                   weight.data_ptr(), 1e-6, normed.data_ptr(), *([] if f32 else [head_out.data_ptr()]),
                   logits.data_ptr(), finite.data_ptr(), greedy.data_ptr(),
                   *([] if f32 else [widened.data_ptr()]), 2)
            assert finite.tolist() == [1, 1]
            assert greedy.tolist() == logits.max(dim=-1).indices.tolist(), (vocab, dtype)
            if head is not base and head.abs().sum():
                assert logits[0].eq(logits[0].max()).sum() >= 2  # the tie is really there
