"""Multi-LoRA, torch reference path: an adapter bank of fixed slots and grouped shrink/expand.

Each targeted linear `y = x W^T + b` gets `y += (x A_s^T) B_s^T` for the tokens whose slot is
s, where A is [rank, in] and B is [out, rank] with the LoRA scale already folded in by the
registry. Slots are padded to `max_rank` with zeros; slot -1 is the base model (no correction).
One batch can mix adapters and the base model: the step's `LoRABatch` (row permutation and
segments, built once per step by `set_token_slots`) is shared by every projection, and a
`LoRABackend` (torch grouped shrink/expand, or Triton BGMV/SGMV) computes the correction.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from services.common.errors import InvalidArgument
from services.decoder.kernels import BASE_SLOT, LoRABackend, LoRABatch, TorchLoRABackend  # noqa: F401 (BASE_SLOT re-exported)
from services.decoder.linear import linear

TARGET_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter's factors by module name (e.g. "model.layers.0.self_attn.q_proj").

    a: float32 [rank, in_features]; b: float32 [out_features, rank], already scaled.
    """

    digest: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


class AdapterBank:
    """Fixed slots of adapter weights, keyed by content digest, with leases and an LRU.

    A slot holding a leased adapter is never reused; unleased resident slots are recycled
    least recently used first. Each lease carries the adapter name its request was admitted under
    ("" for callers without one): two registry names loaded from the same files share a slot, but
    the registry drains and unloads them by name. When every slot is leased a load returns None and the caller
    registers `when_slot_frees` to retry once a lease ends (admission waits, never fails). Loading into a slot rewrites every target buffer of that slot.
    Thread-safe: the engine thread reads while the servicer thread loads.
    """

    def __init__(self, num_slots: int, max_rank: int, module_shapes: dict[str, tuple[int, int]],
                 dtype: torch.dtype = torch.float32, backend: LoRABackend | None = None) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.module_shapes = module_shapes  # name -> (in_features, out_features)
        self.dtype = dtype
        self.lock = threading.RLock()
        self._a: dict[str, torch.Tensor] = {}  # name -> [slots, max_rank, in]
        self._b: dict[str, torch.Tensor] = {}  # name -> [slots, out, max_rank], a view of [slots, max_rank, out]
        self._digests: list[str | None] = [None] * num_slots
        self._leases = [0] * num_slots
        self._named: list[Counter[str]] = [Counter() for _ in range(num_slots)]  # slot -> leases by name
        self._idle: OrderedDict[int, None] = OrderedDict()  # unleased resident slots, LRU first
        self.backend = backend or TorchLoRABackend()
        self._batch: LoRABatch | None = None  # this step's row permutation / segments
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

        Raises:
            InvalidArgument: unknown module name, factors that are not 2-D float tensors, shape
                mismatch, rank above max_rank, or values not finite in the bank's dtype.
        """
        self._validate(weights)
        with self.lock:
            slot = self.slot_of(weights.digest)
            if slot is not None:
                return slot
            slot = self._free_slot()
            if slot is None:
                return None
            for name in self._a:
                self._a[name][slot].zero_()
                self._b[name][slot].zero_()
            for name, (a, b) in weights.modules.items():
                self._buffers(name)
                rank = a.shape[0]
                self._a[name][slot, :rank] = a.to(self.dtype)
                self._b[name][slot, :, :rank] = b.to(self.dtype)
            self._digests[slot] = weights.digest
            self.num_swaps += 1
            self._idle[slot] = None
            return slot

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

    def _buffers(self, name: str) -> None:
        if name not in self._a:
            in_f, out_f = self.module_shapes[name]
            self._a[name] = torch.zeros(self.num_slots, self.max_rank, in_f, dtype=self.dtype)
            # B^T of each slot contiguous: the expand reads [rank, out] rows (cpu and torch backends)
            self._b[name] = torch.zeros(self.num_slots, self.max_rank, out_f, dtype=self.dtype).transpose(1, 2)

    def set_token_slots(self, token_slots: torch.Tensor | None, decode_rows: torch.Tensor | None = None) -> None:
        """Build the step's LoRA metadata once, reused by every projection of the forward.

        token_slots: int64 [num_tokens] slot per row (-1 = base); None = all base.
        decode_rows: int64 rows that decode one token (BGMV); the rest are prefill (SGMV).
        """
        self._batch = None if token_slots is None else LoRABatch.build(token_slots, decode_rows)
        if token_slots is None:
            self.backend.end_step()

    @property
    def active(self) -> bool:
        """True while a step with at least one adapter row is running."""
        return self._batch is not None

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the LoRA correction of module `name` to `y` [num_tokens, out] in place (x: [num_tokens, in])."""
        if name not in self._a or self._batch is None:
            return
        self.backend.add_lora(y, x, self._a[name], self._b[name], self._batch)


class LoRALinear(nn.Linear):
    """nn.Linear whose output gets the bank's per-token LoRA correction (parameter names unchanged)."""

    lora_name: str = ""
    lora_bank: AdapterBank | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        if self.lora_bank is not None and self.lora_bank.active:
            self.lora_bank.apply(self.lora_name, x, y)
        return y


def attach_bank(model: nn.Module, bank: AdapterBank) -> None:
    """Point every LoRALinear of `model` at `bank`."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.lora_bank = bank


def target_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-capable linear, by module name."""
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, LoRALinear)}


class HostAdapterCache:
    """The host-memory tier: adapter weights by digest, bounded by bytes, least recently used out.

    More adapters than device slots can be in use: a swap-in into an idle slot copies from here
    instead of fetching the weights from the registry again (and works while it is down).
    `max_bytes` counts the float32 A and B factors; 0 keeps nothing.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, tuple[LoRAWeights, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, digest: str) -> LoRAWeights | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            self._entries.move_to_end(digest)
            return entry[0]

    def put(self, weights: LoRAWeights) -> None:
        """Keep `weights` (evicting the least recently used); one larger than max_bytes is not kept."""
        size = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in weights.modules.values())
        with self._lock:
            old = self._entries.pop(weights.digest, None)
            if old is not None:
                self.num_bytes -= old[1]
            if size > self.max_bytes:
                return
            while self.num_bytes + size > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.num_bytes -= evicted
            self._entries[weights.digest] = (weights, size)
            self.num_bytes += size
