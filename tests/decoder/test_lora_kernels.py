"""Triton BGMV/SGMV kernels (CPU interpreter) equal the torch backend and a float64 reference.

Triton reads TRITON_INTERPRET when the kernels are defined, so the cases run in a subprocess
with it set (see lora_kernel_cases.py): odd sizes, ranks 1..64 padded to the bank's max rank,
base rows (slot -1) mixed in, decode rows through BGMV and slot-sorted segments through SGMV.
"""

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.decoder.lora.batch import LoRABatch
from services.decoder.lora.cpu_backend import CpuLoRABackend
from services.decoder.lora.registry import make_backend

ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_in_interpreter_equal_torch_and_float64():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("lora_kernel_cases.py"))], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == 5
    assert {r["case"][4] for r in results} >= {1, 64}           # max ranks 1 and 64 covered
    assert any(r["num_decode"] for r in results) and any(r["num_segments"] > 1 for r in results)
    for r in results:
        assert r["ref_change"] > 0.1, r
        for key in ("triton_err", "torch_err", "bgmv_raw_err", "sgmv_raw_err", "triton_vs_torch"):
            assert r[key] < 1e-4, (key, r)
        assert r["triton_base_exact"] and r["torch_base_exact"], r


def test_batch_metadata_sorts_prefill_rows_into_segments():
    slots = torch.tensor([2, -1, 0, 0, 2, 0, 2, -1])
    batch = LoRABatch.build(slots, decode_rows=torch.tensor([0, 1]))
    assert batch.decode_rows.tolist() == [0] and batch.decode_slots.tolist() == [2]
    assert batch.prefill_perm.tolist() == [2, 3, 5, 4, 6]
    assert batch.seg_starts.tolist() == [0, 3] and batch.seg_lens.tolist() == [3, 2]
    assert batch.seg_slots.tolist() == [0, 2] and batch.max_seg_len == 3
    assert [(s, r.tolist()) for s, r in batch.slot_rows] == [(0, [2, 3, 5]), (2, [0, 4, 6])]
    assert LoRABatch.build(torch.full((4,), -1)) is None


def test_backend_flag_validation():
    assert make_backend("torch").name == "torch"
    with pytest.raises(ValueError, match="lora_backend must be one of"):
        make_backend("cuda")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="no CUDA device"):
            make_backend("triton")


def test_torch_backend_padded_groups_equal_per_slot_loop_and_float64():
    torch.manual_seed(3)
    x, a, b = torch.randn(13, 37), torch.randn(4, 8, 37), torch.randn(4, 29, 8)
    a[2, 5:] = 0                                                 # rank 5 padded to 8
    slots = torch.tensor([0, 1, -1, 2, 3, 0, 1, 2, 3, -1, 0, 1, 2])
    padded = LoRABatch.build(slots, torch.arange(13))
    looped = LoRABatch.build(slots, torch.arange(13))
    object.__setattr__(looped, "padded", None)                   # force the per-slot loop
    assert padded.padded is not None and padded.padded.max_len == 3
    y0 = torch.randn(13, 29)
    ref = y0.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            ref[t] += (x[t].double() @ a[s].double().T) @ b[s].double().T
    outs = []
    for batch in (padded, looped):
        y = y0.clone()
        make_backend("torch").add_lora(y, x, a, b, batch)
        outs.append(y)
        assert (y.double() - ref).abs().max() < 1e-4 and torch.equal(y[[2, 9]], y0[[2, 9]])
    assert (outs[0] - outs[1]).abs().max() < 1e-4
    every_row = torch.tensor([3, 0, 1, 0, 2, 3, 1])              # no base row: deltas added in row order
    full, full_looped = LoRABatch.build(every_row, torch.arange(7)), LoRABatch.build(every_row, torch.arange(7))
    object.__setattr__(full_looped, "padded", None)
    assert full.padded.row_cells is not None
    x7, y7 = torch.randn(7, 37), torch.randn(7, 29)
    backend, ys = make_backend("torch"), []
    for batch in (full, full_looped):
        y = y7.clone()
        backend.add_lora(y, x7, a, b, batch)
        ys.append(y)
    ref7 = y7.double() + torch.stack([(x7[t].double() @ a[s].double().T) @ b[s].double().T
                                      for t, s in enumerate(every_row.tolist())])
    assert (ys[0].double() - ref7).abs().max() < 1e-4 and (ys[0] - ys[1]).abs().max() < 1e-4
    one_long = LoRABatch.build(torch.tensor([0] * 40 + [1, 2]), torch.tensor([40, 41]))
    assert one_long.padded is None                               # padding would triple the rows: loop


@pytest.mark.parametrize("index", range(5))
def test_cpu_backend_equals_torch_and_float64(index):
    """The cpu backend (C BGMV for decode and prefill rows) on the Triton cases' odd sizes, ranks
    1..64 padded to the max rank, slot -1 mixed in; B in the bank's layouts (the transposed view of
    [slots, rank, out], and tiled B^T: the same bits) and plain contiguous."""
    from lora_kernel_cases import CASES, make_case, reference

    from services.decoder.lora.slots import tile_b

    x, y0, a, b, slots, decode = make_case(index, *CASES[index])
    ref = reference(x, y0, a, b, slots)
    batch = LoRABatch.build(slots, decode)
    base = slots == -1
    expected = y0.clone()
    make_backend("torch").add_lora(expected, x, a, b, batch)
    bank_layout = b.transpose(1, 2).contiguous().transpose(1, 2)
    backend = make_backend("cpu")
    results = []
    for factors in (bank_layout, b, tile_b(b)):
        y = y0.clone()
        backend.add_lora(y, x, a, factors, batch)
        backend.end_step()
        assert (y.double() - ref).abs().max() < 1e-4
        assert (y - expected).abs().max() < 1e-4
        assert torch.equal(y[base], y0[base])
        results.append(y)
    assert torch.equal(results[0], results[2])  # tiled: the same sums in the same order
    assert (ref - y0.double()).abs().max() > 0.1  # the correction is not negligible


def test_cpu_backend_all_decode_rows_thread_count_invariant():
    torch.manual_seed(7)
    x, y0 = torch.randn(32, 576), torch.randn(32, 1536)
    a = torch.randn(8, 16, 576) / 24
    b = torch.randn(8, 16, 1536).transpose(1, 2)  # the bank's layout
    slots = torch.arange(32) % 9 - 1              # 8 adapters and base rows, interleaved
    batch = LoRABatch.build(slots, torch.arange(32))
    ref = y0.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            ref[t] += (x[t].double() @ a[s].double().T) @ b[s].double().T
    outs = []
    threads = torch.get_num_threads()
    for n in (threads, 1):
        torch.set_num_threads(n)
        try:
            y = y0.clone()
            make_backend("cpu").add_lora(y, x, a, b, batch)
            outs.append(y)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert (outs[0].double() - ref).abs().max() < 1e-4


@pytest.mark.parametrize("index", range(5))
def test_cpu_backend_bfloat16_factors_on_float32_rows_equal_float64(index):
    """--lora-dtype bfloat16 on a float32 model: the C BGMV (decode rows) and the torch backend
    (prefill rows) widen each bfloat16 factor exactly, so the result is the float64 product of the
    rounded factors within float32 summation error, and differs from the float32 factors'."""
    from lora_kernel_cases import CASES, make_case, reference

    x, y0, a, b, slots, decode = make_case(index, *CASES[index])
    a16, b16 = a.bfloat16(), b.transpose(1, 2).contiguous().transpose(1, 2).bfloat16()
    ref = reference(x, y0, a16.float(), b16.float(), slots)
    batch = LoRABatch.build(slots, decode)
    backend = make_backend("cpu")
    y = y0.clone()
    backend.add_lora(y, x, a16, b16, batch)
    backend.end_step()
    assert (y.double() - ref).abs().max() < 1e-4
    assert torch.equal(y[slots == -1], y0[slots == -1])
    assert (ref - reference(x, y0, a, b, slots)).abs().max() > 1e-4  # the rounding is visible


def test_cpu_backend_refuses_bad_inputs_before_touching_y():
    x, y = torch.randn(6, 8), torch.randn(6, 5)
    a, b = torch.randn(2, 4, 8), torch.randn(2, 4, 5).transpose(1, 2)
    batch = LoRABatch.build(torch.tensor([0, 1, 0, 1, -1, 0]), torch.tensor([0, 1]))  # decode + prefill rows
    before = y.clone()
    backend = make_backend("cpu")
    for args, message in (((y, x, a, b.half()), "float32 or bfloat16"), ((y, x.double(), a, b), "float32 or bfloat16"),
                          ((y, x, a.bfloat16(), b), "float32 or bfloat16"),
                          ((y.bfloat16(), x.bfloat16(), a, b), "float32 or bfloat16"),
                          ((y.half(), x.half(), a.half(), b.half()), "float32 or bfloat16"),
                          ((y, x, a, b[:, :4]), "shapes do not fit"), ((y, x[:, :7], a, b), "shapes do not fit")):
        with pytest.raises(ValueError, match=message):
            backend.add_lora(*args, batch)
        assert torch.equal(y, before)


@pytest.mark.parametrize("rank", [1, 5, 16])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_cpu_backend_one_adapter_splits_its_factors_over_threads(rank, rows):
    """One adapter group (batch 1, or a few rows of one adapter) on more threads than groups: the
    shrink splits the slot's rank rows of A among threads, the expand its outputs; equal to float64
    and bit for bit the same on one thread (odd ranks: uneven parts; 6 rows: a second ROWS block)."""
    torch.manual_seed(rank * 10 + rows)
    x, y0 = torch.randn(rows, 200), torch.randn(rows, 300)
    a = torch.randn(3, rank, 200) / 14
    b = torch.randn(3, rank, 300).transpose(1, 2)  # the bank's layout
    slots = torch.full((rows,), 2)
    batch = LoRABatch.build(slots, torch.arange(rows))
    ref = y0.double() + (x.double() @ a[2].double().T) @ b[2].double().T
    outs, threads = [], torch.get_num_threads()
    for n in (2, 1):
        torch.set_num_threads(n)
        try:
            y = y0.clone()
            make_backend("cpu").add_lora(y, x, a, b, batch)
            outs.append(y)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert (outs[0].double() - ref).abs().max() < 1e-4


class _Part(ctypes.Structure):
    """lora_bgmv.c's bgmv_part_t."""

    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("y", ctypes.c_void_p), ("y_stride", ctypes.c_int64),
                ("out_features", ctypes.c_int64), ("rank", ctypes.c_int64), ("tiled", ctypes.c_int64)]


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16)], ids=["f32", "f32-bf16w", "bf16"])
@pytest.mark.parametrize("groups", [[(1, 1)], [(0, 3), (2, 1), (1, 5)]], ids=["batch1", "three-groups"])
def test_bgmv_parts_call_equals_one_call_per_part(dtypes, groups):
    """The fused decode step's one call over the projections that read the same x (q, k, v at
    their columns of one output): each part bit for bit its own single-part call's result, at 2
    threads and at 1, with B^T tiled (AdapterSlots' layout for the cpu backend) or [rank, out] rows,
    and the float64 product; parts of odd widths and ranks (1 to 16)."""
    from services.decoder.kernels import native
    from services.decoder.lora.slots import tile_b

    act, factor = dtypes
    suffix = {(torch.float32, torch.float32): "f32", (torch.float32, torch.bfloat16): "f32_bf16w",
              (torch.bfloat16, torch.bfloat16): "bf16"}[dtypes]
    library = native.load()
    torch.manual_seed(len(groups))
    num_rows, in_f = sum(n for _, n in groups), 131
    widths, ranks = (300, 70, 129), (16, 5, 1)
    x = torch.randn(num_rows + 2, in_f).to(act)  # rows 0..num_rows-1 adapter rows, the rest untouched
    y0 = torch.randn(num_rows + 2, sum(widths) + 3).to(act)
    factors = [((torch.randn(4, r, in_f) / 12).to(factor), torch.randn(4, r, w).to(factor))
               for w, r in zip(widths, ranks)]
    rows = torch.randperm(num_rows)
    starts = torch.tensor([0] + [sum(n for _, n in groups[:i + 1]) for i in range(len(groups))])
    slots = torch.tensor([slot for slot, _ in groups])
    columns = [sum(widths[:i]) + 1 for i in range(3)]

    tiles = [tile_b(bt.transpose(1, 2)) for _, bt in factors]  # [slots, rank * out]

    def call(y, which, threads, tiled):
        parts = (_Part * len(which))(*(
            _Part(factors[p][0].data_ptr(), (tiles[p] if tiled else factors[p][1]).data_ptr(),
                  y[:, columns[p]:].data_ptr(), y.stride(0), widths[p], ranks[p], tiled) for p in which))
        shrunk = torch.empty(len(which), num_rows, max(ranks[p] for p in which))
        getattr(library, f"tessera_lora_bgmv_parts_{suffix}")(
            x.data_ptr(), in_f, parts, len(which), rows.data_ptr(), starts.data_ptr(), slots.data_ptr(), slots.numel(),
            in_f, shrunk.data_ptr(), threads)
        return y

    def single_calls(tiled):
        y = y0.clone()
        for p in range(3):
            call(y, [p], 2, tiled)
        return y

    fused, alone, one_thread = call(y0.clone(), [0, 1, 2], 2, 0), single_calls(0), call(y0.clone(), [0, 1, 2], 1, 0)
    assert torch.equal(fused, alone) and torch.equal(fused, one_thread)
    assert torch.equal(fused, call(y0.clone(), [0, 1, 2], 2, 1)) and torch.equal(fused, single_calls(1))
    expected = y0.double()
    for g, (slot, _) in enumerate(groups):
        for t in rows[starts[g]:starts[g + 1]].tolist():
            for (a, bt), c, w in zip(factors, columns, widths):
                expected[t, c:c + w] += (x[t].double() @ a[slot].double().T) @ bt[slot].double()
    tolerance = 1e-4 if act == torch.float32 else 2 ** -7 * float(expected.abs().max())
    assert (fused.double() - expected).abs().max() < tolerance
    assert torch.equal(fused[num_rows:], y0[num_rows:]) and torch.equal(fused[:, :1], y0[:, :1])
    assert (expected - y0.double()).abs().max() > 0.1  # the corrections are not negligible


@pytest.fixture(scope="module", params=["native", "avx2", "portable"])
def bgmv_library(request):
    """The kernel library as this machine builds it (AVX-512 / AVX512-BF16 where it has them), as an
    AVX2 + FMA host without AVX-512 builds it, and portable."""
    from services.decoder.kernels import native

    if request.param == "avx2":
        if not {"avx2", "fma"} <= native.cpu_flags():
            pytest.fail("this x86 test machine has no AVX2 + FMA: the avx2 build cannot run here")
        return native.build(march=native.AVX2_MARCH)
    return native.load() if request.param == "native" else native.build(portable=True)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16)], ids=["f32", "f32-bf16w", "bf16"])
@pytest.mark.parametrize("in_f", [131, 576])
def test_a_rows_correction_is_the_same_bits_alone_and_in_a_group(bgmv_library, dtypes, in_f):
    """A row alone (batch 1: the one-row shrink and expand) gets the bits it gets as one of a group's
    eight rows (a prompt's), four rows, or as a group's last (its tail), for parts of odd widths and
    ranks (3 to 16, rank 5 not a multiple of the one-row shrink's four), at 1 and 2 threads, in each
    build of the kernels, from B^T tiled or in [rank, out] rows."""
    from services.decoder.lora.slots import tile_b

    act, factor = dtypes
    suffix = {(torch.float32, torch.float32): "f32", (torch.float32, torch.bfloat16): "f32_bf16w",
              (torch.bfloat16, torch.bfloat16): "bf16"}[dtypes]
    library = bgmv_library
    torch.manual_seed(in_f)
    widths, ranks = (300, 70, 2100), (16, 5, 3)  # 2100: past the streamed expand's 2048 outputs
    x = torch.randn(14, in_f).to(act)
    y0 = torch.randn(14, sum(widths)).to(act)
    factors = [((torch.randn(3, r, in_f) / 12).to(factor), torch.randn(3, r, w).to(factor))
               for w, r in zip(widths, ranks)]
    columns = [sum(widths[:i]) for i in range(3)]

    tiles = [tile_b(bt.transpose(1, 2)) for _, bt in factors]  # [slots, rank * out]

    def call(rows, starts, slots, threads, tiled=0):
        y = y0.clone()
        parts = (_Part * 3)(*(_Part(a.data_ptr(), (t if tiled else bt).data_ptr(), y[:, c:].data_ptr(), y.stride(0),
                                    w, r, tiled)
                              for (a, bt), t, c, w, r in zip(factors, tiles, columns, widths, ranks)))
        rows, starts, slots = (torch.tensor(v, dtype=torch.long) for v in (rows, starts, slots))
        shrunk = torch.empty(3, rows.numel(), max(ranks))
        getattr(library, f"tessera_lora_bgmv_parts_{suffix}")(
            x.data_ptr(), in_f, parts, 3, rows.data_ptr(), starts.data_ptr(), slots.data_ptr(), slots.numel(), in_f,
            shrunk.data_ptr(), threads)
        # x . A, float32 (a bf16 y rounds most differences away): part p's rows at p * rows * max rank, each rank long
        return y, [shrunk[p].flatten()[:rows.numel() * r].view(rows.numel(), r) for p, r in enumerate(ranks)]

    for threads in (1, 2):
        # slot 2: rows 0-7 eight at a time, 8-11 four, 12 the tail; slot 0: row 13 alone
        grouped, grouped_shrunk = call(list(range(14)), [0, 13, 14], [2, 0], threads)
        assert torch.equal(grouped, call(list(range(14)), [0, 13, 14], [2, 0], threads, tiled=1)[0])
        for row, slot in ((0, 2), (7, 2), (8, 2), (11, 2), (12, 2), (13, 0)):
            alone, alone_shrunk = call([row], [0, 1], [slot], threads)
            assert torch.equal(alone[row], grouped[row]), (threads, row)
            assert torch.equal(alone[row], call([row], [0, 1], [slot], threads, tiled=1)[0][row]), (threads, row)
            assert not torch.equal(alone[row], y0[row])
            for part in range(len(ranks)):
                assert torch.equal(alone_shrunk[part][0], grouped_shrunk[part][row]), (threads, row, part)


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_a_bfloat16_sum_below_the_normal_range_is_rounded_not_flushed(bgmv_library, rows):
    """y + correction rounded to bf16 as torch rounds: a sum in float32's denormal range keeps its
    value (VCVTNEPS2BF16 alone flushes it to zero); x . A = 1 and B^T = 2^-130 make the correction
    exactly 2^-130 (a bf16 denormal) on y = 0; every other column sums to 2^-130 * 1.5 the same way."""
    width = 150  # two 64-output chunks (four 32-output ones) and a tail
    x = torch.ones(rows, 40, dtype=torch.bfloat16)
    a = torch.zeros(1, 1, 40, dtype=torch.bfloat16)
    a[0, 0, 0] = 1
    bt = torch.full((1, 1, width), 2.0 ** -130).to(torch.bfloat16)
    bt[0, 0, 1::2] = torch.tensor(2.0 ** -130 * 1.5 + 2.0 ** -133).to(torch.bfloat16)  # exact in bf16: 2^-130 (1 + 1/2 + 1/8)
    y = torch.zeros(rows, width, dtype=torch.bfloat16)
    y[:, 1::2] = torch.tensor(-(2.0 ** -133)).to(torch.bfloat16)  # the sums 2^-130 (1 + 1/2): exact
    expected = (y.float() + bt[0].float()).to(torch.bfloat16)  # each exact in float32: torch's rounding
    assert expected.float().abs().min() > 0  # every sum is a denormal that survives
    parts = (_Part * 1)(_Part(a.data_ptr(), bt.data_ptr(), y.data_ptr(), width, width, 1, 0))
    indices, starts, slots = (torch.tensor(v, dtype=torch.long) for v in (list(range(rows)), [0, rows], [0]))
    shrunk = torch.empty(rows, 1)
    bgmv_library.tessera_lora_bgmv_parts_bf16(x.data_ptr(), 40, parts, 1, indices.data_ptr(), starts.data_ptr(),
                                              slots.data_ptr(), 1, 40, shrunk.data_ptr(), 2)
    assert torch.equal(y, expected)


def test_a_step_whose_every_row_decodes_gets_the_metadata_of_the_tensor_ops():
    """`LoRABatch.build` computes an all-decode CPU step's metadata on the slots' ints: every field,
    and the BGMV's decode groups, equal to what the tensor ops make of the same step."""
    import random

    rng = random.Random(0)
    cases = [[3], [-1], [-1, -1], [0, -1, 0], [2, 2, 0, -1, 1, 0, 2]] + [
        [rng.choice([-1, 0, 1, 5, 7]) for _ in range(rng.randrange(1, 40))] for _ in range(30)]
    for slots in cases:
        token_slots = torch.tensor(slots)
        rows = torch.arange(len(slots))
        fast, ops = LoRABatch.build(token_slots, rows), LoRABatch._from_ops(token_slots, rows)
        if all(slot == -1 for slot in slots):
            assert fast is None and ops is None
            continue
        assert "decode_groups" in vars(fast)  # the int path ran: it sets decode_groups up front
        assert "decode_groups" not in vars(ops)
        for name in ("token_slots", "decode_rows", "decode_slots", "prefill_perm", "seg_starts", "seg_lens",
                     "seg_slots"):
            assert torch.equal(getattr(fast, name), getattr(ops, name)), (slots, name)
            assert getattr(fast, name).dtype == torch.long
        assert fast.max_seg_len == ops.max_seg_len == 0 and fast.num_segments == 0
        assert [s for s, _ in fast.slot_rows] == [s for s, _ in ops.slot_rows]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fast.slot_rows, ops.slot_rows))
        assert all(torch.equal(a, b) for a, b in zip(fast.decode_groups, ops.decode_groups)), slots


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16)], ids=["f32", "f32-bf16w", "bf16"])
def test_cpu_backend_parts_call_equals_a_call_per_part(dtypes):
    """A fused projection's parts (q, k, v: LoRALinear.lora_slices) in one `add_lora_parts` call get
    the bits of an `add_lora` per part, for decode and prefill rows of three adapters and base rows,
    four parts (past one call's three), and a part whose factors are refused: nothing is added."""
    from services.decoder.lora.context import LoRAContext

    act, factor = dtypes
    torch.manual_seed(7)
    in_f, widths, rank = 96, (64, 16, 16, 40), 8
    slots = torch.tensor([0, 2, -1, 1, 1, 1, 0, 0, -1, 2])  # rows 0, 1, 2 decode; 3.. prefill
    batch = LoRABatch.build(slots, torch.tensor([0, 1, 2]))
    x = torch.randn(slots.numel(), in_f).to(act)
    y0 = torch.randn(slots.numel(), sum(widths)).to(act)
    factors = [((torch.randn(3, rank, in_f) / 8).to(factor), torch.randn(3, w, rank).to(factor)) for w in widths]
    bounds = [(sum(widths[:i]), sum(widths[:i + 1])) for i in range(len(widths))]
    backend = CpuLoRABackend()
    one_each = y0.clone()
    for (a, b), (start, end) in zip(factors, bounds):
        backend.add_lora(one_each[:, start:end], x, a, b, batch)
    parts = y0.clone()
    backend.add_lora_parts(parts, x, [(a, b, start, end) for (a, b), (start, end) in zip(factors, bounds)], batch)
    assert torch.equal(parts, one_each) and not torch.equal(parts, y0)
    assert torch.equal(parts[[2, 8]], y0[[2, 8]])  # base rows

    class Slots:  # LoRAContext reads factors by module name
        def factors(self, name):
            return factors[int(name)]

    context = LoRAContext(Slots(), backend)
    with context.step(slots, torch.tensor([0, 1, 2])):
        through = y0.clone()
        context.apply_slices(tuple((str(i), start, end) for i, (start, end) in enumerate(bounds)), x, through)
    assert torch.equal(through, one_each)
    wrong = y0.clone()
    bad = [(a, b, start, end) for (a, b), (start, end) in zip(factors, bounds)]
    bad[2] = (bad[2][0][:, :, :5], bad[2][1], *bounds[2])  # A of the wrong in_features
    with pytest.raises(ValueError, match="shapes do not fit"):
        backend.add_lora_parts(wrong, x, bad, batch)
    past = [(a, b, start, end) for (a, b), (start, end) in zip(factors, bounds)]
    past[3] = (*past[3][:2], sum(widths) - 10, sum(widths) + 30)  # columns past y's: its slice is 10 wide
    with pytest.raises(ValueError, match=r"columns \[126, 166\) are not within y's 136"):
        backend.add_lora_parts(wrong, x, past, batch)
    assert torch.equal(wrong, y0)
