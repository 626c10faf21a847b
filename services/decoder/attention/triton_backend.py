"""The triton attention backend: every row, prefill and decode, in one Triton kernel launch (triton_kernel.py).

Needs a GPU, or TRITON_INTERPRET=1 on CPU (Triton reads it when the kernel is defined, so the
kernel module is imported when the backend is constructed, not before), and a power-of-two block_size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.decoder.attention.backend import AttentionBackend, AttentionMetadata, cache_slots, check_attention_options
from services.decoder.block_manager import padded_block_tables

if TYPE_CHECKING:
    from services.decoder.kv_cache import KVCache
    from services.decoder.scheduler import ScheduledRequest


@dataclass(kw_only=True)
class TritonAttentionMetadata(AttentionMetadata):
    """Inputs of `triton_paged_attention`: block_tables int32 [num_seqs, max_blocks] (padded with
    block 0), token_seq int32 [num_tokens] (each row's sequence), context_lens int32 [num_tokens]
    (query position + 1)."""

    block_tables: torch.Tensor
    token_seq: torch.Tensor
    context_lens: torch.Tensor
    block_size: int


class TritonAttentionBackend(AttentionBackend[TritonAttentionMetadata]):
    """One program per (query row, head) reading its context block by block (online softmax)."""

    name = "triton"

    @classmethod
    def check_config(cls, block_size: int, dtype: str) -> None:
        if block_size & (block_size - 1):
            raise ValueError(f"the triton attention backend needs a power-of-two block_size, got {block_size}")

    def __init__(self) -> None:
        from services.decoder.attention.triton_kernel import triton_paged_attention  # defines the kernel

        self._kernel = triton_paged_attention

    def build_metadata(self, scheduled: Sequence[ScheduledRequest], block_tables: Sequence[Sequence[int]],
                       cache: KVCache) -> TritonAttentionMetadata:
        """Per-token sequence rows and causal context lengths; block tables padded with block 0."""
        block_size = cache.block_size
        slot_mapping = torch.cat([cache_slots(table, item.start, item.end, block_size)
                                  for item, table in zip(scheduled, block_tables)])
        token_seq = torch.cat([torch.full((item.num_new_tokens,), row, dtype=torch.int32)
                               for row, item in enumerate(scheduled)])
        context_lens = torch.cat([torch.arange(item.start + 1, item.end + 1, dtype=torch.int32) for item in scheduled])
        return TritonAttentionMetadata(slot_mapping=slot_mapping, write_index=cache.write_index(slot_mapping),
                                       block_tables=padded_block_tables(block_tables), token_seq=token_seq,
                                       context_lens=context_lens, block_size=block_size)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TritonAttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        check_attention_options(sliding_window, logits_soft_cap)
        return self._kernel(query, k_cache, v_cache, meta.block_tables, meta.token_seq, meta.context_lens,
                            meta.block_size, scale, sliding_window, logits_soft_cap)
