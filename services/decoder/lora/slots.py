"""Adapter slots: which adapters are resident on the device, their factors, and who leases them.

Each targeted linear `y = x W^T + b` of the model gets `y += (x A_s^T) B_s^T` for the rows whose
slot is s, where A is [rank, in] and B is [out, rank] with the LoRA scale already folded in by the
registry. `AdapterSlots` keeps every slot's A and B (padded to `max_rank` with zeros) in one buffer
per module; the model runner's `LoRAContext` (context.py) reads them each step and hands them
to a `LoRABackend`. Slot -1 (`BASE_SLOT`) is the base model, no correction.

Routed MoE experts (PEFT's `target_parameters` on transformers 5's 3-D expert weights) are adapted
per expert: module names "<layer>.mlp.experts.<e>.<part>" (part gate_up_proj or down_proj). The E
experts of one part share one buffer, `factors("<layer>.mlp.experts.<part>")`, whose row
`slot * E + e` holds slot s's factors of expert e: the MoE block hands the backend that row as
the "slot" of each (token, expert) row it computes (moe.py), so every adapter and expert of a
step is corrected in one batched shrink/expand per part.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument, ResourceExhausted
from services.common.lora_names import expert_target
from services.common.memory import back_with_huge_pages

EXPAND_TILE = 64  # lora_bgmv.c's CHUNK: outputs per tile of a tiled B^T


def b_views(bt: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tiled B^T [rows, rank * out] (lora_bgmv.c's `bt_run`: out's whole EXPAND_TILE-output tiles, each
    [rank, EXPAND_TILE], then the last out % EXPAND_TILE outputs as [rank, out % EXPAND_TILE]) seen as B:
    (tiles [rows, out // EXPAND_TILE, EXPAND_TILE, rank], tail [rows, out % EXPAND_TILE, rank]), views
    of its storage (writing them writes it)."""
    rows, tiles = bt.shape[0], out_features // EXPAND_TILE
    rank, whole = bt.shape[1] // out_features, out_features // EXPAND_TILE * EXPAND_TILE
    head = bt[:, :whole * rank].view(rows, tiles, rank, EXPAND_TILE).transpose(2, 3)
    tail = bt[:, whole * rank:].view(rows, rank, out_features - whole).transpose(1, 2)
    return head, tail


def write_b(bt: torch.Tensor, b: torch.Tensor, rows: int | None = None) -> None:
    """Write B (one row's [out, r], or every row's [rows, out, r] where `rows` is None; r <= the buffer's
    rank) into the first r ranks of tiled B^T `bt`'s row `rows`, or of all its rows (`b_views`)."""
    rows = slice(None) if rows is None else rows
    head, tail = b_views(bt, b.shape[-2])
    whole, rank = head.shape[1] * EXPAND_TILE, b.shape[-1]
    head[rows, ..., :rank].copy_(b[..., :whole, :].unflatten(-2, (head.shape[1], EXPAND_TILE)))
    tail[rows, ..., :rank].copy_(b[..., whole:, :])


def tile_b(b: torch.Tensor) -> torch.Tensor:
    """B [rows, out, rank] as a tiled B^T [rows, rank * out] (a copy; `b_views`)."""
    rows, out_features, rank = b.shape
    bt = torch.empty(rows, rank * out_features, dtype=b.dtype, device=b.device)
    write_b(bt, b)
    return bt


def untile_b(bt: torch.Tensor, out_features: int) -> torch.Tensor:
    """A tiled B^T [rows, rank * out] as B [rows, out, rank] (a copy; `b_views`)."""
    head, tail = b_views(bt, out_features)
    return torch.cat([head.reshape(bt.shape[0], -1, head.shape[3]), tail], dim=1)


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter's factors by module name (e.g. "model.layers.0.self_attn.q_proj").

    a: float32 [rank, in_features]; b: float32 [out_features, rank], already scaled.
    """

    digest: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


class AdapterSlots:
    """Fixed slots of adapter weights, keyed by content digest, with leases and an LRU.

    A slot holding a leased adapter is never reused; unleased resident slots are recycled
    least recently used first. Each lease carries the adapter name its request was admitted under
    ("" for callers without one): two registry names loaded from the same files share a slot, but
    the registry drains and unloads them by name. When every slot is leased a load returns None and
    the caller registers `when_slot_frees` to retry once a lease ends (admission waits, never fails).
    Loading into a slot rewrites every target buffer of that slot.

    Thread-safe: the registry client loads and leases from the event loop while the engine thread
    runs steps. A step takes no lock: every row of a step belongs to a request that holds a lease on
    its slot until the engine thread retires it after the step, and a load writes only a slot
    without leases, so the rows a forward reads never change under it (`factors`).
    """

    def __init__(self, num_slots: int, max_rank: int, module_shapes: dict[str, tuple[int, int]],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 expert_parts: dict[str, int] | None = None, tiled_bt: bool = False) -> None:
        """`module_shapes`: module name -> (in_features, out_features), per-expert names included;
        `expert_parts`: "<layer>.mlp.experts.<part>" -> number of experts, for the parts whose
        per-expert modules share a stacked buffer (module docstring; `layers.target_shapes`);
        `tiled_bt`: B stored as tiled B^T (`b_views`), the layout the cpu backend reads front to back."""
        self.tiled_bt = tiled_bt
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.module_shapes = module_shapes  # name -> (in_features, out_features)
        self.dtype = dtype
        self.device = torch.device(device)  # the model's: slot buffers live beside the weights they correct
        self.lock = threading.RLock()
        # buffer key -> rows per slot: 1 for a module, E for a stacked expert part (module docstring)
        expert_parts = expert_parts or {}
        self._rows_per_slot: dict[str, int] = {}
        self._place: dict[str, tuple[str, int]] = {}  # module name -> (buffer key, row within its slot)
        for name in module_shapes:
            placed = expert_target(name)
            key, expert = placed if placed is not None and placed[0] in expert_parts else (name, 0)
            self._place[name] = (key, expert)
            self._rows_per_slot[key] = expert_parts.get(key, 1)
        self._a: dict[str, torch.Tensor] = {}  # key -> [slots * rows per slot, max_rank, in]
        # key -> [slots * rows, out, max_rank], a view of [.., max_rank, out]; tiled: [slots * rows, max_rank * out]
        self._b: dict[str, torch.Tensor] = {}
        self._digests: list[str | None] = [None] * num_slots
        self._leases = [0] * num_slots
        self._named: list[Counter[str]] = [Counter() for _ in range(num_slots)]  # slot -> leases by name
        self._idle: OrderedDict[int, None] = OrderedDict()  # unleased resident slots, LRU first
        self._waiters: list[Callable[[], None]] = []  # admissions waiting for a slot to free
        self.num_swaps = 0  # adapters written into a slot (swap-ins)

    def slot_of(self, digest: str) -> int | None:
        with self.lock:
            return self._digests.index(digest) if digest in self._digests else None

    def digest_of(self, slot: int) -> str | None:
        """Weight digest resident in `slot` (None when empty); prefix-cache keys use it."""
        with self.lock:
            return self._digests[slot]

    def acquire(self, digest: str, name: str = "") -> int | None:
        """Lease the slot holding `digest` for a request admitted as adapter `name`; None if it is
        not resident."""
        with self.lock:
            slot = self.slot_of(digest)
            if slot is not None:
                self._leases[slot] += 1
                self._named[slot][name] += 1
                self._idle.pop(slot, None)
            return slot

    def release(self, slot: int, name: str = "") -> None:
        """Drop one lease of `slot` taken as `name`; the last one makes the slot idle and wakes
        admissions waiting for a slot.

        Raises:
            ValueError: `slot` holds no lease taken as `name`.
        """
        waiters: list[Callable[[], None]] = []
        with self.lock:
            if self._named[slot][name] <= 0:
                raise ValueError(f"slot {slot} has no lease of adapter {name!r} to release")
            self._named[slot][name] -= 1
            if not self._named[slot][name]:
                del self._named[slot][name]
            self._leases[slot] -= 1
            if self._leases[slot] == 0:
                self._idle[slot] = None
                waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()

    def when_slot_frees(self, wake: Callable[[], None]) -> bool:
        """Call `wake()` (once, from the releasing thread) when a slot becomes idle.

        Returns False, registering nothing, if a slot is already empty or idle (retry the load now).
        """
        with self.lock:
            if None in self._digests or self._idle:
                return False
            self._waiters.append(wake)
            return True

    def load_and_acquire(self, weights: LoRAWeights, name: str = "") -> int | None:
        """`load` then lease the slot for `name` atomically (no concurrent load can evict it in
        between); None if every slot is leased. Raises what `load` raises."""
        with self.lock:
            slot = self.load(weights)
            return None if slot is None else self.acquire(weights.digest, name)

    def num_leases(self, slot: int) -> int:
        return self._leases[slot]

    def num_idle(self) -> int:
        """Slots that are empty or resident without leases (reusable by a load)."""
        with self.lock:
            return self._digests.count(None) + len(self._idle)

    def residency(self) -> dict[str, int]:
        """{digest: leases} of every resident adapter (what the decoder reports to the registry)."""
        with self.lock:
            return {d: self._leases[s] for s, d in enumerate(self._digests) if d is not None}

    def leases_by_name(self) -> dict[str, dict[str, int]]:
        """{digest: {admission name: leases}} of every resident adapter with leases."""
        with self.lock:
            return {d: dict(self._named[s]) for s, d in enumerate(self._digests) if d is not None and self._leases[s]}

    def load(self, weights: LoRAWeights) -> int | None:
        """Make `weights` resident (not leased); returns its slot, or None if every slot is leased.
        A digest already resident returns its slot at once: its factors were checked when they were
        loaded (checking every value again took 15 ms a request for SmolLM2's 210 rank-16 factor
        pairs, a third of a 32-token prompt's prefill).

        Raises:
            InvalidArgument: unknown module name, factors that are not 2-D float tensors, shape
                mismatch, rank above max_rank, or values not finite in the slots' dtype.
            ResourceExhausted: a module's slot buffer, allocated on its first use, does not fit the
                device (nothing is evicted).
        """
        with self.lock:
            slot = self.slot_of(weights.digest)
        if slot is not None:
            return slot
        self._validate(weights)  # outside the lock where the caller does not hold it: leases go on meanwhile
        with self.lock:
            slot = self.slot_of(weights.digest)  # loaded by another thread meanwhile
            if slot is not None:
                return slot
            buffers = len(self._a)
            for name in weights.modules:  # every buffer first: one that cannot be allocated evicts nothing
                self._buffers(self._place[name][0], name)
            grown = [*self._a.values(), *self._b.values()] if len(self._a) != buffers else []
            slot = self._swap_in(weights)
        if grown and self.device.type == "cpu":  # each step reads the slots' factors: in huge pages
            back_with_huge_pages(grown)  # (services/common/memory.py); steps meanwhile read the same values
        return slot

    def _swap_in(self, weights: LoRAWeights) -> int | None:
        """Copy `weights` into a free slot (zeroed first; lock held, buffers allocated); None if
        every slot is leased."""
        slot = self._free_slot()
        if slot is None:
            return None
        self._zero(slot)
        for name, (a, b) in weights.modules.items():
            key, expert = self._place[name]
            row, rank = slot * self._rows_per_slot[key] + expert, a.shape[0]
            # from pinned host memory (HostAdapterCache on CUDA) the copy runs asynchronously,
            # ordered before the next step's kernels on the device's stream
            self._a[key][row, :rank].copy_(a, non_blocking=True)
            if self.tiled_bt:
                write_b(self._b[key], b, row)
            else:
                self._b[key][row, :, :rank].copy_(b, non_blocking=True)
        self._digests[slot] = weights.digest
        self.num_swaps += 1
        self._idle[slot] = None
        return slot

    def unload(self, digest: str) -> None:
        """Empty the slot holding `digest` (zeroed, taken first by the next load); nothing when it
        is not resident.

        Raises:
            ValueError: the slot is leased.
        """
        with self.lock:
            slot = self.slot_of(digest)
            if slot is None:
                return
            if self._leases[slot]:
                raise ValueError(f"slot {slot} holding {digest!r} is leased {self._leases[slot]} time(s)")
            self._zero(slot)
            self._digests[slot] = None
            self._idle.pop(slot, None)

    def _free_slot(self) -> int | None:
        if None in self._digests:
            return self._digests.index(None)
        if not self._idle:
            return None
        slot, _ = self._idle.popitem(last=False)
        self._digests[slot] = None
        return slot

    def _validate(self, weights: LoRAWeights) -> None:
        for name, (a, b) in weights.modules.items():
            if name not in self.module_shapes:
                raise InvalidArgument(f"adapter targets unknown module {name[:200]!r}")
            if a.dim() != 2 or b.dim() != 2 or not (a.is_floating_point() and b.is_floating_point()):
                raise InvalidArgument(f"adapter factors at {name} must be 2-D float tensors, got {a.dtype} "
                                      f"{tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
            in_f, out_f = self.module_shapes[name]
            rank = a.shape[0]
            if rank > self.max_rank:
                raise InvalidArgument(f"adapter rank {rank} at {name} exceeds max_lora_rank {self.max_rank}")
            if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
                raise InvalidArgument(f"adapter factors at {name} have shapes {tuple(a.shape)}, {tuple(b.shape)}; "
                                      f"expected ({rank}, {in_f}) and ({out_f}, {rank})")
            if not (torch.isfinite(a.to(self.dtype)).all() and torch.isfinite(b.to(self.dtype)).all()):
                raise InvalidArgument(f"adapter factors at {name} hold values that are not finite in {self.dtype} "
                                      "(NaN, inf, or past its range)")

    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A [slots, max_rank, in], B [slots, out, max_rank]) of module `name`, or with `tiled_bt`
        (A, B^T tiled [slots, max_rank * out]: `b_views`, `untile_b`); None while no
        resident adapter has ever targeted it. For a stacked expert part "<layer>.mlp.experts.<part>"
        the first dimension is slots * experts, row slot * experts + expert (module docstring).
        Lock-free: called per projection of every step."""
        a = self._a.get(name)
        return None if a is None else (a, self._b[name])

    @property
    def num_buffers(self) -> int:
        """How many modules (buffer keys) have factor buffers: it grows as adapters first target
        modules and never shrinks (a caller that caches `factors` re-reads them when it changes)."""
        return len(self._a)

    def _zero(self, slot: int) -> None:
        for key, a in self._a.items():
            rows = slice(slot * self._rows_per_slot[key], (slot + 1) * self._rows_per_slot[key])
            a[rows].zero_()
            self._b[key][rows].zero_()

    def _buffers(self, key: str, name: str) -> None:
        """Allocate buffer `key` (of module `name`'s shape) on its first use.

        Raises:
            ResourceExhausted: the device cannot hold it (a stacked expert part holds every slot's
                factors of every expert: slots * experts * max_rank * (in + out) values), naming its size.
        """
        if key not in self._a:
            in_f, out_f = self.module_shapes[name]
            rows = self.num_slots * self._rows_per_slot[key]
            try:
                # B^T of each slot contiguous: the expand reads [rank, out] rows (torch backend) or tiles
                # (cpu backend). B before A: `factors` reads without the lock and finds B wherever it finds A.
                b = torch.zeros(rows, self.max_rank, out_f, dtype=self.dtype, device=self.device)
                b = b.view(rows, -1) if self.tiled_bt else b.transpose(1, 2)
                a = torch.zeros(rows, self.max_rank, in_f, dtype=self.dtype, device=self.device)
            except RuntimeError as error:  # torch.OutOfMemoryError, or the host's allocator
                size = rows * self.max_rank * (in_f + out_f) * torch.tensor([], dtype=self.dtype).element_size()
                raise ResourceExhausted(f"LoRA slots for {key[:200]} need {size / 2**30:.2f} GiB ({rows} slot rows x "
                                        f"max_lora_rank {self.max_rank} x {in_f} + {out_f}) and the {self.device} "
                                        f"device cannot hold them ({' '.join(str(error).split())[:200]}); lower "
                                        "--adapter-slots or --max-lora-rank") from None
            self._b[key], self._a[key] = b, a
