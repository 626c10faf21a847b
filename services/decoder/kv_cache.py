"""The paged KV cache tensors: one K and one V pool per layer, head-major."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.memory import advise_huge_pages, back_with_huge_pages


@dataclass(frozen=True)
class KVBlockLayout:
    """What one KV-cache block holds, for sizing the cache from a memory budget.

    One block is `block_size` token slots of K and of V in every layer: num_layers x 2 x
    block_size x num_kv_heads x head_dim elements of `dtype` (the `KVCache` pools below, whose
    dtype is the model's, or bfloat16 under a float32 model with --kv-cache-dtype bfloat16).
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def describe(self) -> str:
        """"30 layers x K,V x 16 tokens x 3 kv heads x 64 x 4 bytes (float32)"."""
        return (f"{self.num_layers} layers x K,V x {self.block_size} tokens x {self.num_kv_heads} kv heads x "
                f"{self.head_dim} x {self.dtype.itemsize} bytes ({str(self.dtype).removeprefix('torch.')})")


class KVCache:
    """K and V pools, each `[num_kv_heads, num_blocks * block_size, head_dim]` per layer, of `dtype`
    (the model's, or narrower: the attention backends widen what they read to the query's dtype).

    Slot s of kv head h is row h * num_slots + s of the flat view `[num_kv_heads * num_slots,
    head_dim]` (see `BlockManager` for the slot mapping). Head-major, as vLLM's CPU cache: a
    gather of slots gives each kv head's context contiguous, the layout SDPA reads.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)  # where the model runner builds each step's inputs
        # one allocation in huge pages on the CPU (a step reads each row's blocks of every layer:
        # with 4 KiB pages nearly every block of a head is a TLB miss): marked before it is zeroed,
        # so fresh memory faults in huge; memory malloc reused (already in 4 KiB pages) is collapsed
        pools = torch.empty(2, num_layers, *shape, dtype=dtype, device=device)
        advise_huge_pages(pools)
        pools.zero_()
        back_with_huge_pages([pools])
        self.key, self.value = list(pools[0].unbind(0)), list(pools[1].unbind(0))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s ([kv_heads, slots, head_dim],) * 2."""
        return self.key[layer], self.value[layer]

    def write_index(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Flat rows int64 [kv_heads * num_tokens] (head-major) of tokens at `slot_mapping` [num_tokens]."""
        heads = torch.arange(self.num_kv_heads, device=slot_mapping.device)[:, None] * self.num_slots
        return (heads + slot_mapping[None, :]).reshape(-1)

    def write(self, layer: int, write_index: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `key`/`value` [num_tokens, kv_heads, head_dim] at `write_index` (from `write_index`).

        A cache narrower than the model (--kv-cache-dtype bfloat16 on a float32 model) stores them
        rounded to its dtype (to nearest even, `.to`). Values not finite as stored (only a request
        whose activations overflowed writes them, or a float32 value past bfloat16's range; its own
        logits are then non-finite and it ends with an error) are stored as 0 in V: blocks are reused, and
        attention multiplies padded slots by probability 0, which a stale NaN or inf would turn into
        NaN for an unrelated request. Padded K never matters (its scores are masked to -inf).
        """
        head_dim = key.shape[-1]
        keys = key.transpose(0, 1).reshape(-1, head_dim).to(self.dtype)
        values = torch.nan_to_num(value.transpose(0, 1).reshape(-1, head_dim).to(self.dtype), nan=0.0, posinf=0.0,
                                  neginf=0.0)
        # a row copy; faster than index_put on CPU
        self.key[layer].view(-1, head_dim).index_copy_(0, write_index, keys)
        self.value[layer].view(-1, head_dim).index_copy_(0, write_index, values)
