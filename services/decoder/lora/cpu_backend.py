"""The cpu LoRA backend: every adapter row through the C BGMV kernel (kernels/lora_bgmv.c)."""

from __future__ import annotations

import ctypes

import torch

from services.decoder.kernels import native
from services.decoder.lora.backend import LoRABackend
from services.decoder.lora.batch import LoRABatch


class BgmvPart(ctypes.Structure):
    """lora_bgmv.c's bgmv_part_t: one projection of a `_parts` call."""

    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("y", ctypes.c_void_p), ("y_stride", ctypes.c_int64),
                ("out_features", ctypes.c_int64), ("rank", ctypes.c_int64), ("tiled", ctypes.c_int64)]


class CpuLoRABackend(LoRABackend):
    """Every adapter row, decode and prefill, through the C BGMV kernel (kernels/lora_bgmv.c).

    The kernel groups a step's rows by slot and reads each slot's A and B^T once per projection,
    four rows at a time, adding into y in place. The torch backend, which this backend once used for
    prefill rows, gathers the rows onto a padded grid (and, when the slots present are not the first
    ones, every slot's factors) for two bmm and scatters the deltas back: on SmolLM2's 210 projections
    at rank 16 it took 326 ms where the kernel takes 104 (8 slots x 128 prefill rows), 111 against 84
    (one slot x 512), 39 against 29 (8 x 32), 16 against 10 (8 x 4), and one kernel gives a row the
    same numbers whether it decodes or prefills. x, y, A and B all float32, or all bfloat16 (float32
    sums, y rounded once, as the torch backend), or float32 x, y with bfloat16 A, B (--lora-dtype
    bfloat16: the factors widened exactly). B is read as AdapterSlots stores it for this backend
    (`tiled_bt`: B^T in tiles [slots, max_rank * out], slots.py `b_views`) or for the others (the
    transposed view of a contiguous [slots, max_rank, out]); other layouts of B [slots, out, max_rank]
    are copied per call.
    """

    name = "cpu"
    tiled_bt = True

    def __init__(self) -> None:
        library = native.load()
        self._step: tuple[LoRABatch, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        # id(b) -> (b, B^T contiguous): the slots' buffers never move, so each factor's B^T view is
        # made once (b held here, so its id stays its own); a prompt's 210 calls made 210 views a step
        self._transposed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._shrunk = torch.empty(0, dtype=torch.float32)  # the kernel's scratch, grown as needed
        self._parts_kernels = {(torch.float32, torch.float32): library.tessera_lora_bgmv_parts_f32,
                               (torch.bfloat16, torch.bfloat16): library.tessera_lora_bgmv_parts_bf16,
                               (torch.float32, torch.bfloat16): library.tessera_lora_bgmv_parts_f32_bf16w}
        self._c_parts = (BgmvPart * 3)()  # the `_parts` call's part array, refilled per call

    def add_lora(self, y, x, a, b, batch):
        """The contract's `add_lora` (backend.py); b also as AdapterSlots' tiled B^T [slots, max_rank * out]."""
        self.add_lora_parts(y, x, [(a, b, 0, y.shape[1])], batch)

    def add_lora_parts(self, y: torch.Tensor, x: torch.Tensor,
                       parts: list[tuple[torch.Tensor, torch.Tensor, int, int]], batch: LoRABatch) -> None:
        """`add_lora` of each part (a, b, first column, end column) into its columns of
        `y` [rows, out], all reading `x`, in one kernel call (lora_bgmv.c's `_parts`: one parallel region
        for a fused projection's q, k and v, or gate and up, where a call per part made one each): each
        part's columns get the bits its own `add_lora` gives (tests/decoder/test_lora_kernels.py).

        Raises:
            ValueError: as `add_lora`, for any part, before anything is added.
        """
        kernel = self._parts_kernels.get((y.dtype, parts[0][0].dtype))
        for _, _, start, end in parts:
            if not 0 <= start < end <= y.shape[1]:
                raise ValueError(f"LoRA part columns [{start}, {end}) are not within y's {y.shape[1]}")
        if len({a.dtype for a, _, _, _ in parts}) > 1:
            raise ValueError(f"LoRA parts of one call share a factor dtype, got {[a.dtype for a, _, _, _ in parts]}")
        checked = [self._checked(kernel, y[:, start:end], x, a, b) for a, b, start, end in parts]  # (a, bt, tiled)
        for first in range(len(self._c_parts), len(parts), len(self._c_parts)):  # more than a call takes
            self.add_lora_parts(y, x, parts[first:first + len(self._c_parts)], batch)
        parts, checked = parts[:len(self._c_parts)], checked[:len(self._c_parts)]
        rows, starts, slots = self._groups(batch)
        if x.stride(-1) != 1:
            x = x.contiguous()
        c_parts, max_rank = self._c_parts, max(a.shape[1] for a, _, _ in checked)
        for part, (a, bt, tiled), (_, _, start, end) in zip(c_parts, checked, parts):
            part.a, part.bt, part.y = a.data_ptr(), bt.data_ptr(), y.data_ptr() + start * y.element_size()
            part.y_stride, part.out_features, part.rank, part.tiled = y.stride(0), end - start, a.shape[1], tiled
        kernel(x.data_ptr(), x.stride(0), c_parts, len(parts), rows.data_ptr(), starts.data_ptr(), slots.data_ptr(),
               slots.numel(), x.shape[1], self._scratch(len(parts) * rows.numel() * max_rank),
               torch.get_num_threads())

    def _checked(self, kernel, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor,
                 b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(A contiguous, B^T contiguous, 1 if tiled else 0) for a kernel call adding x's correction to y;
        ValueError naming what does not fit (kernel None: no kernel for the dtypes)."""
        if kernel is None or x.dtype != y.dtype or b.dtype != a.dtype:
            raise ValueError(f"the cpu LoRA backend computes float32 or bfloat16 (x, y one dtype, a, b one dtype, "
                             f"bfloat16 factors on float32 activations allowed), got {x.dtype}, {y.dtype}, "
                             f"{a.dtype}, {b.dtype}")
        if y.stride(-1) != 1:
            raise ValueError("LoRA output must have a contiguous last dimension")
        num_slots, rank, in_f = a.shape
        expected = (num_slots, rank * y.shape[1]) if b.dim() == 2 else (num_slots, y.shape[1], rank)
        if b.shape != expected or x.shape[1] != in_f or x.shape[0] != y.shape[0]:
            raise ValueError(f"LoRA shapes do not fit: x {tuple(x.shape)}, y {tuple(y.shape)}, "
                             f"a {tuple(a.shape)}, b {tuple(b.shape)}")
        if b.dim() == 2:  # AdapterSlots' tiled B^T
            return (a if a.is_contiguous() else a.contiguous()), (b if b.is_contiguous() else b.contiguous()), 1
        held = self._transposed.get(id(b))
        if held is None or held[0] is not b:
            held = (b, b.transpose(1, 2).contiguous())  # no copy for AdapterSlots' layout
            if held[1].data_ptr() == b.data_ptr():  # a view of b's buffer: kept (another layout is copied per call)
                self._transposed[id(b)] = held
        return (a if a.is_contiguous() else a.contiguous()), held[1], 0

    def _scratch(self, values: int) -> int:
        """The address of a float32 scratch of at least `values` values (the kernel's shrunk rows)."""
        if self._shrunk.numel() < values:
            self._shrunk = torch.empty(values, dtype=torch.float32)
        return self._shrunk.data_ptr()

    def end_step(self) -> None:
        self._step = None

    def _groups(self, batch: LoRABatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every adapter row grouped by slot: (rows int64 [n], group starts int64 [groups + 1], group
        slots int64 [groups]), contiguous; built once per step."""
        if self._step is not None and self._step[0] is batch:
            return self._step[1]
        rows = torch.cat([group for _, group in batch.slot_rows])
        lens = torch.tensor([group.numel() for _, group in batch.slot_rows], dtype=torch.long)
        starts = torch.zeros(lens.numel() + 1, dtype=torch.long)
        torch.cumsum(lens, 0, out=starts[1:])
        groups = (rows.contiguous(), starts, torch.tensor([slot for slot, _ in batch.slot_rows], dtype=torch.long))
        self._step = (batch, groups)
        return groups
