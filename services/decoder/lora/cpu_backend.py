"""The cpu LoRA backend: decode rows through the C BGMV kernel (kernels/lora_bgmv.c)."""

from __future__ import annotations

import torch

from services.decoder.kernels import native
from services.decoder.lora.backend import LoRABackend
from services.decoder.lora.batch import BASE_SLOT, LoRABatch
from services.decoder.lora.torch_backend import TorchLoRABackend


class CpuLoRABackend(LoRABackend):
    """Decode rows through the C BGMV kernel (kernels/lora_bgmv.c), prefill rows through the torch backend.

    A decode step is memory-bound on the factors: the kernel reads each slot's A and B^T once per
    projection and adds into y in place, where the torch backend gathers rows onto a padded grid,
    runs two bmm and scatters the deltas back. Prefill segments are compute-bound GEMMs, which MKL
    (the torch backend) does best. x, y, A and B all float32, or all bfloat16 (float32 sums, y
    rounded once, as the torch backend), or float32 x, y with bfloat16 A, B (--lora-dtype bfloat16:
    the factors widened exactly); B must be stored as AdapterSlots stores it (the
    transposed view of a contiguous [slots, max_rank, out]; other layouts are copied per call).
    """

    name = "cpu"

    def __init__(self) -> None:
        library = native.load()
        # (activation dtype, factor dtype) -> kernel; bfloat16 factors on a float32 model: --lora-dtype
        self._kernels = {(torch.float32, torch.float32): library.tessera_lora_bgmv_f32,
                         (torch.bfloat16, torch.bfloat16): library.tessera_lora_bgmv_bf16,
                         (torch.float32, torch.bfloat16): library.tessera_lora_bgmv_f32_bf16w}
        self._torch = TorchLoRABackend()
        self._step: tuple[LoRABatch, tuple | None, LoRABatch | None] | None = None

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
        decode, prefill = self._split(batch)
        if prefill is not None:
            self._torch.add_lora(y, x, a, b, prefill)
        if decode is None:
            return
        if x.stride(-1) != 1:
            x = x.contiguous()
        a, bt = a.contiguous(), b.transpose(1, 2).contiguous()  # no copies for AdapterSlots' layout
        rows, starts, slots = decode
        shrunk = torch.empty(rows.numel(), rank, dtype=torch.float32)
        kernel(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), a.data_ptr(), bt.data_ptr(),
               rows.data_ptr(), starts.data_ptr(), slots.data_ptr(), slots.numel(), in_f, bt.shape[2], rank,
               shrunk.data_ptr(), torch.get_num_threads())

    def end_step(self) -> None:
        self._step = None
        self._torch.end_step()

    def _split(self, batch: LoRABatch) -> tuple[tuple | None, LoRABatch | None]:
        """(decode rows grouped by slot: rows, group starts [g + 1], group slots; or None) and the
        prefill rows' own LoRABatch (None without prefill adapter rows), built once per step."""
        if self._step is not None and self._step[0] is batch:
            return self._step[1], self._step[2]
        decode = batch.decode_groups
        prefill = None
        if batch.prefill_perm.numel():
            token_slots = batch.token_slots.clone()
            token_slots[batch.decode_rows] = BASE_SLOT
            prefill = LoRABatch.build(token_slots)
        self._step = (batch, decode, prefill)
        return decode, prefill
