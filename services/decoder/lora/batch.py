"""Per-step LoRA batch metadata: computed once per scheduler step, reused by every projection.

Rows of the flat batch carry an adapter slot (-1 = base model, no correction). Decode rows
(one new token per request) go to BGMV, one row per program; prefill rows are permuted so that
rows of one slot are contiguous and cut into segments (the SGMV layout, as in Punica):

    token_slots:   [ 2, -1,  0,  0,  0,  2,  2, -1 ]     row 0 decodes; rows 2..6 prefill
    decode_rows:   [0]            decode_slots: [2]
    prefill_perm:  [2, 3, 4, 5, 6]                        (stable sort of prefill rows by slot)
    segments:      start [0, 3]  len [3, 2]  slot [0, 2]

`slot_rows` groups every adapter row (decode and prefill) by slot for the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

BASE_SLOT = -1


@dataclass(frozen=True)
class LoRABatch:
    token_slots: torch.Tensor    # int64 [num_tokens], -1 = base
    decode_rows: torch.Tensor    # int64 [num_decode] adapter rows that decode (BGMV)
    decode_slots: torch.Tensor   # int64 [num_decode]
    prefill_perm: torch.Tensor   # int64 [num_prefill] adapter prefill rows sorted by slot (SGMV)
    seg_starts: torch.Tensor     # int64 [num_segments] offsets into prefill_perm
    seg_lens: torch.Tensor       # int64 [num_segments]
    seg_slots: torch.Tensor      # int64 [num_segments]
    max_seg_len: int
    slot_rows: tuple[tuple[int, torch.Tensor], ...]  # (slot, int64 rows) over all adapter rows

    @property
    def num_segments(self) -> int:
        return int(self.seg_slots.numel())

    @cached_property
    def padded(self) -> PaddedGroups | None:
        """Adapter rows as a [num slots present, longest group] grid for one batched shrink/expand
        pair (torch backend); built on first use, then shared by every projection of the step. None
        when padding would more than double the rows (e.g. one long prefill beside a few decodes)."""
        lens = [int(rows.numel()) for _, rows in self.slot_rows]
        longest, total = max(lens), sum(lens)
        if len(lens) == 1 or len(lens) * longest > 2 * total:
            return None
        device = self.token_slots.device
        rows = torch.cat([rows for _, rows in self.slot_rows])
        # grid cell g * longest + j holds row j of group g; padding cells repeat the group's first
        # row (their results are computed and dropped, never written back)
        grid_rows = torch.cat([torch.cat([r, r[:1].expand(longest - r.numel())]) for _, r in self.slot_rows])
        cells = torch.cat([g * longest + torch.arange(n, device=device) for g, n in enumerate(lens)])
        slot_list = [s for s, _ in self.slot_rows]
        row_cells = None
        if total == self.token_slots.numel():  # every row has an adapter: deltas come back in row order
            row_cells = torch.empty_like(cells).index_copy_(0, rows, cells)
        return PaddedGroups(torch.tensor(slot_list, device=device), slot_list == list(range(len(slot_list))),
                            rows, grid_rows, cells if total < len(lens) * longest else None, longest, row_cells)

    @cached_property
    def decode_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The decode rows grouped by slot for BGMV (kernels/lora_bgmv.c): (rows int64 [num_decode],
        group starts int64 [groups + 1], group slots int64 [groups]), contiguous; None without decode
        rows. Built on first use, then shared by every projection of the step."""
        if not self.decode_rows.numel():
            return None
        order = torch.sort(self.decode_slots, stable=True).indices
        slots, counts = torch.unique_consecutive(self.decode_slots[order], return_counts=True)
        starts = torch.zeros(slots.numel() + 1, dtype=torch.long, device=slots.device)
        torch.cumsum(counts, 0, out=starts[1:])
        return self.decode_rows[order].contiguous(), starts, slots.contiguous()

    @classmethod
    def build(cls, token_slots: torch.Tensor, decode_rows: torch.Tensor | None = None) -> LoRABatch | None:
        """Metadata for one step; None when every row is base (no LoRA work at all).

        token_slots: int64 [num_tokens]; decode_rows: int64 row indices of decode tokens (None =
        treat every row as prefill). Both on the device the kernels run on.
        """
        token_slots = token_slots.to(torch.long)
        if (decode_rows is not None and decode_rows.numel() == token_slots.numel()
                and token_slots.device.type == "cpu"):
            return cls._every_row_decodes(token_slots)
        return cls._from_ops(token_slots, decode_rows)

    @classmethod
    def _from_ops(cls, token_slots: torch.Tensor, decode_rows: torch.Tensor | None) -> LoRABatch | None:
        """`build` in tensor ops on the slots' device (token_slots int64)."""
        adapter = token_slots != BASE_SLOT
        if not bool(adapter.any()):
            return None
        is_decode = torch.zeros_like(adapter)
        if decode_rows is not None and decode_rows.numel():
            is_decode[decode_rows.to(token_slots.device)] = True
        dec = torch.nonzero(adapter & is_decode).squeeze(1)
        pre = torch.nonzero(adapter & ~is_decode).squeeze(1)
        order = torch.sort(token_slots[pre], stable=True).indices
        perm = pre[order]
        seg_slots, seg_lens = torch.unique_consecutive(token_slots[perm], return_counts=True)
        seg_starts = torch.cumsum(seg_lens, 0) - seg_lens
        rows = torch.nonzero(adapter).squeeze(1)
        slots, counts = torch.unique(token_slots[rows], return_counts=True)
        grouped = rows[torch.sort(token_slots[rows], stable=True).indices].split(counts.tolist())
        return cls(token_slots, dec, token_slots[dec], perm, seg_starts, seg_lens, seg_slots,
                   int(seg_lens.max()) if seg_lens.numel() else 0,
                   tuple(zip(slots.tolist(), grouped, strict=True)))

    @classmethod
    def _every_row_decodes(cls, token_slots: torch.Tensor) -> LoRABatch | None:
        """`build`'s metadata for a CPU step whose every row decodes, computed on the slots' ints
        (one op reads them, one makes every vector: slices of one tensor). `build`'s dozen index ops
        ran cold at batch 1, after the weights had streamed through the caches: ~330 us a token on a
        2-core AMD EPYC, ~40 us this way. The same values as the ops (tests/decoder/test_lora_kernels.py)."""
        slots = token_slots.tolist()
        rows = [row for row, slot in enumerate(slots) if slot != BASE_SLOT]
        if not rows:
            return None
        grouped = sorted(rows, key=slots.__getitem__)  # stable: rows ascend within a slot
        group_slots = sorted({slots[row] for row in rows})
        starts = [0]
        for at in range(1, len(grouped)):
            if slots[grouped[at]] != slots[grouped[at - 1]]:
                starts.append(at)
        starts.append(len(grouped))
        n, g = len(rows), len(group_slots)
        flat = torch.tensor(rows + [slots[row] for row in rows] + grouped + starts + group_slots, dtype=torch.long)
        grouped_rows, group_starts = flat[2 * n:3 * n], flat[3 * n:3 * n + g + 1]
        empty = flat[:0]
        batch = cls(token_slots, flat[:n], flat[n:2 * n], empty, empty, empty, empty, 0,
                    tuple((slot, grouped_rows[starts[i]:starts[i + 1]]) for i, slot in enumerate(group_slots)))
        # decode_groups' value, set where the cached_property keeps it
        batch.__dict__["decode_groups"] = (grouped_rows, group_starts, flat[3 * n + g + 1:])
        return batch


@dataclass(frozen=True)
class PaddedGroups:
    """Group g (slot slots[g]) fills cells [g * max_len, (g + 1) * max_len) of a flat grid:
    `grid_rows` is the flat-batch row in each cell; `cells[i]` is the cell of `rows[i]`."""

    slots: torch.Tensor       # int64 [num_groups] adapter slot of each group, ascending
    leading_slots: bool       # slots == 0..num_groups-1 (the first adapter slots: no weight gather)
    rows: torch.Tensor        # int64 [num_rows] adapter rows, grouped by slot
    grid_rows: torch.Tensor   # int64 [num_groups * max_len]
    cells: torch.Tensor | None  # int64 [num_rows]; None when no cell is padding (cells == arange)
    max_len: int
    row_cells: torch.Tensor | None = None  # int64 [num_tokens] cell of each flat-batch row, when all are adapter rows
