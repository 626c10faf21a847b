"""The attention backend interface: per-step metadata from the scheduled batch, the K/V write, attention.

A backend turns a scheduled batch into its own metadata once per step (`build_metadata`); every
layer then writes its new K/V (`write_kv`) and attends over the paged cache (`forward`) with that
metadata. The model runner owns one backend (chosen by name, see `services/decoder/attention`)
and hands it, with the step's metadata, to the model; models never know which backend runs.

The cache is head-major (kv_cache.py): one layer's K is [kv_heads, slots, head_dim]; slot s of
kv head h is row h * num_slots + s of the flat view. A token's slot comes from its block table:

    slot(position) = block_table[position // block_size] * block_size + position % block_size

This module imports nothing from the backends below it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import torch

if TYPE_CHECKING:
    from services.decoder.kv_cache import KVCache
    from services.decoder.scheduler import ScheduledRequest


@dataclass(kw_only=True)
class AttentionMetadata:
    """What every backend's metadata holds: where this step's new K/V go.

    slot_mapping: int64 [num_tokens], the cache slot of each row of the flat batch.
    write_index: int64 [kv_heads * num_tokens], those slots as flat cache rows (`KVCache.write_index`);
        None in metadata built by hand for attention alone (nothing is written), and in the cpu
        backend's, whose `write_kv` reads `slot_mapping` itself.
    """

    slot_mapping: torch.Tensor
    write_index: torch.Tensor | None = None


M = TypeVar("M", bound=AttentionMetadata)


class AttentionBackend(ABC, Generic[M]):
    """Paged attention over the head-major KV cache, with its own per-step metadata type `M`.

    Contract: for query rows [num_tokens, heads, head_dim] of a flat batch (rows of one request
    consecutive, in the order scheduled), `forward` returns what causal attention over each row's
    context (positions 0..its own, or with a sliding window its last `sliding_window` of them, read
    through the block table, this step's K/V included) gives;
    grouped-query heads share KV as transformers' `repeat_kv` (head h reads kv head
    h // (heads / kv_heads)). Backends agree with the torch backend within float rounding.
    """

    name: ClassVar[str]

    @classmethod
    def check_config(cls, block_size: int, dtype: str) -> None:
        """Refuse a cache this backend cannot serve, before anything is built (none refused here).

        Raises:
            ValueError: naming the setting and the backend's limit.
        """

    @abstractmethod
    def build_metadata(self, scheduled: Sequence[ScheduledRequest], block_tables: Sequence[Sequence[int]],
                       cache: KVCache) -> M:
        """The step's metadata: `scheduled[i]` computes positions [start, end) of its request, whose
        blocks are `block_tables[i]` (covering at least `end` positions)."""

    def write_kv(self, cache: KVCache, layer: int, key: torch.Tensor, value: torch.Tensor, meta: M) -> None:
        """Store this step's `key`/`value` [num_tokens, kv_heads, head_dim] of `layer` in `cache`."""
        cache.write(layer, meta.write_index, key, value)

    @abstractmethod
    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: M,
                scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """Attention of `query` [num_tokens, heads, head_dim] over one layer's caches [kv_heads, slots,
        head_dim] (already holding this step's K/V); returns [num_tokens, heads, head_dim], query's dtype.

        sliding_window: a query at absolute position p attends keys at positions kv with
            p - sliding_window < kv <= p (transformers' masking_utils `sliding_window_overlay`:
            `kv_idx > q_idx - sliding_window`); None: every position 0..p. Positions before the
            window are never read, so their blocks may be freed (placeholder ids in the table).
        logits_soft_cap: scores = (q . k) * scale, then cap * tanh(scores / cap), then the mask, then
            a float32 softmax (Gemma 2's eager attention); None: no cap.

        Raises:
            ValueError: sliding_window < 1 or logits_soft_cap <= 0 (`check_attention_options`).
        """


def check_attention_options(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """Refuse a window or soft cap no backend can apply.

    Raises:
        ValueError: sliding_window not None and < 1, or logits_soft_cap not None and <= 0.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")


def cache_slots(block_table: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [start, end) under `block_table`: int64 [end - start].

    Raises:
        ValueError: the table does not cover `end` positions.
    """
    _check_covers(block_table, end, block_size)
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_table, dtype=torch.long)
    return blocks[positions // block_size] * block_size + positions % block_size


def cache_slot(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The cache slot of one position under `block_table` (`cache_slots` of [position, position + 1]
    without tensors: a decode row's, once per row and step).

    Raises:
        ValueError: the table does not cover the position.
    """
    _check_covers(block_table, position + 1, block_size)
    return block_table[position // block_size] * block_size + position % block_size


def _check_covers(block_table: Sequence[int], end: int, block_size: int) -> None:
    if len(block_table) * block_size < end:
        raise ValueError(f"a block table of {len(block_table)} blocks of {block_size} does not cover "
                         f"positions up to {end}")
