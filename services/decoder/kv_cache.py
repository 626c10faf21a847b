"""The paged KV cache tensors: one K and one V pool per layer."""

from __future__ import annotations

import torch


class KVCache:
    """K and V pools, each `[num_blocks, block_size, num_kv_heads, head_dim]` per layer.

    A flat view `[num_blocks * block_size, num_kv_heads, head_dim]` is indexed by slot
    (see `BlockManager` for the slot mapping).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot-indexed views of layer `layer`: ([slots, kv_heads, head_dim],) * 2."""
        k, v = self.key[layer], self.value[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `key`/`value` [num_tokens, kv_heads, head_dim] at `slot_mapping` [num_tokens]."""
        k_flat, v_flat = self.flat(layer)
        k_flat.index_copy_(0, slot_mapping, key)  # a row copy; faster than index_put on CPU
        v_flat.index_copy_(0, slot_mapping, value)
