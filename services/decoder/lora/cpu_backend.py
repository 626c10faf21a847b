"""The cpu LoRA backend: every adapter row through the C BGMV kernel (kernels/lora_bgmv.c)."""

from __future__ import annotations

import torch

from services.decoder.kernels import native
from services.decoder.lora.backend import LoRABackend
from services.decoder.lora.batch import LoRABatch


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
    bfloat16: the factors widened exactly); B must be stored as AdapterSlots stores it (the
    transposed view of a contiguous [slots, max_rank, out]; other layouts are copied per call).
    """

    name = "cpu"

    def __init__(self) -> None:
        library = native.load()
        # (activation dtype, factor dtype) -> kernel; bfloat16 factors on a float32 model: --lora-dtype
        self._kernels = {(torch.float32, torch.float32): library.tessera_lora_bgmv_f32,
                         (torch.bfloat16, torch.bfloat16): library.tessera_lora_bgmv_bf16,
                         (torch.float32, torch.bfloat16): library.tessera_lora_bgmv_f32_bf16w}
        self._step: tuple[LoRABatch, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def add_lora(self, y, x, a, b, batch):
        kernel = self._kernels.get((y.dtype, a.dtype))
        if kernel is None or x.dtype != y.dtype or b.dtype != a.dtype:
            raise ValueError(f"the cpu LoRA backend computes float32 or bfloat16 (x, y one dtype, a, b one dtype, "
                             f"bfloat16 factors on float32 activations allowed), got {x.dtype}, {y.dtype}, "
                             f"{a.dtype}, {b.dtype}")
        if y.stride(-1) != 1:
            raise ValueError("LoRA output must have a contiguous last dimension")
        num_slots, rank, in_f = a.shape
        if b.shape != (num_slots, y.shape[1], rank) or x.shape[1] != in_f or x.shape[0] != y.shape[0]:
            raise ValueError(f"LoRA shapes do not fit: x {tuple(x.shape)}, y {tuple(y.shape)}, "
                             f"a {tuple(a.shape)}, b {tuple(b.shape)}")
        rows, starts, slots = self._groups(batch)
        if x.stride(-1) != 1:
            x = x.contiguous()
        a, bt = a.contiguous(), b.transpose(1, 2).contiguous()  # no copies for AdapterSlots' layout
        shrunk = torch.empty(rows.numel(), rank, dtype=torch.float32)
        kernel(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), a.data_ptr(), bt.data_ptr(),
               rows.data_ptr(), starts.data_ptr(), slots.data_ptr(), slots.numel(), in_f, bt.shape[2], rank,
               shrunk.data_ptr(), torch.get_num_threads())

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
