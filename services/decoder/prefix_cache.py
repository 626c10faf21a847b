"""Block hashes for the prefix cache: a chain over full blocks, salted by what else the block consumed.

    hash(block i) = sha256( parent | token ids of block i | extra keys of block i )

    parent      = hash(block i-1), or 32 zero bytes for block 0
    token ids   = the block's `block_size` ids as little-endian int64, after a length prefix
    extra keys  = strings, each length-prefixed (little-endian int64 byte count, then UTF-8):
                  "base:<quantization>"                      every block, when the base's matrices are
                                                             GGUF-quantized ("Q4_1 exact": the types
                                                             and the kernels' mode, quantized_model.py)
                  "lora:<weight digest>"                     every block, when the request has an adapter
                  "image:<hash>:<rows>:<start>:<end>:<pos>"  every image overlapping the block
                  "mrope:<t>,<h>,<w>:<rope delta>"           every block from the first image's block on
                  "rope:long"                                every block, while the request runs on
                                                             longrope's long factors (rotary.LongRope)

Because each hash includes its parent, salting a block salts every later one: two prompts share
KV only up to the first block where token ids, adapter weights or image contents/positions
differ. The adapter key is its weight digest (never a slot number or name). An image key holds
the vision service's content hash, a digest of the rows and grid this decoder actually received
(`rows_digest`: the hash is only a caller's claim, so rows forged under a real image's hash never
share KV with that image), its physical span and a digest of its M-RoPE positions; the sections
and the rope delta (which moves every later decode position) salt every block from the first one
an image touches.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.decoder.types import PromptInputs

ROOT_PARENT = bytes(32)


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> bytes:
    """The 32-byte sha256 of one block (see the module docstring for the exact encoding)."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else ROOT_PARENT)
    h.update(struct.pack(f"<q{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        data = key.encode()
        h.update(struct.pack("<q", len(data)))
        h.update(data)
    return h.digest()


def _tensor_digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def rows_digest(rows: torch.Tensor, grid_thw: Sequence[int]) -> str:
    """sha256 hex of an image's rows (float32 [t*h*w, hidden], native C-order bytes) and its grid
    (little-endian int64 t, h, w): what the decoder computes the image's KV from. O(rows), once per
    image per request (the prompt builder's thread)."""
    h = hashlib.sha256(struct.pack(f"<{len(grid_thw)}q", *grid_thw))
    h.update(rows.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class ImageKey:
    """Salt for the blocks overlapping physical prompt positions [start, end)."""

    start: int
    end: int
    key: str


def image_keys(prompt: PromptInputs) -> list[ImageKey]:
    """One key per image span: content hash, received rows digest, span and M-RoPE positions digest."""
    keys = []
    for span in prompt.image_spans:
        received = span.rows_digest or rows_digest(span.rows, ())
        positions = "" if prompt.mrope_positions is None else _tensor_digest(prompt.mrope_positions[:, span.start:span.end])
        keys.append(ImageKey(span.start, span.end,
                             f"image:{span.content_hash}:{received}:{span.start}:{span.end}:{positions}"))
    return keys


class BlockHasher:
    """Hashes one request's full blocks incrementally (prompt blocks, then generated ones).

    `hashes` only grows: a block's hash never changes once its tokens are known, preemption
    included, so a recomputing request finds its own evicted-but-cached blocks. The one exception
    is a longrope request switching to its long factors (`use_long_rope`): every block is rehashed,
    as its K/V are recomputed then, and a short-factor block is never reused by a long sequence.
    """

    def __init__(self, block_size: int, lora_digest: str | None = None, images: Sequence[ImageKey] = (),
                 mrope_section: Sequence[int] | None = None, rope_delta: int = 0, base_key: str = "") -> None:
        self.block_size = block_size
        self.lora_key = ((f"base:{base_key}",) if base_key else ()) + ((f"lora:{lora_digest}",) if lora_digest else ())
        self.images = list(images)
        self.first_image_block = min(i.start for i in images) // block_size if images else None
        section = ",".join(str(s) for s in mrope_section or ())
        self.mrope_key = f"mrope:{section}:{rope_delta}"
        self.rope_key: tuple[str, ...] = ()
        self.hashes: list[bytes] = []

    @classmethod
    def for_prompt(cls, block_size: int, prompt: PromptInputs, lora_digest: str | None,
                   mrope_section: Sequence[int] | None, base_key: str = "") -> BlockHasher:
        return cls(block_size, lora_digest, image_keys(prompt), mrope_section, prompt.rope_delta, base_key)

    def extra_keys(self, block_index: int) -> tuple[str, ...]:
        """Extra keys of block `block_index` (positions [i * block_size, (i + 1) * block_size))."""
        keys = [*self.lora_key, *self.rope_key]
        if self.first_image_block is not None and block_index >= self.first_image_block:
            lo, hi = block_index * self.block_size, (block_index + 1) * self.block_size
            keys.extend(i.key for i in self.images if i.start < hi and i.end > lo)
            keys.append(self.mrope_key)
        return tuple(keys)

    def use_long_rope(self, long: bool) -> None:
        """Salt every block with "rope:long" (`long`) or nothing; a change forgets every hash."""
        rope_key = ("rope:long",) if long else ()
        if rope_key != self.rope_key:
            self.rope_key, self.hashes = rope_key, []

    def update(self, token_ids: Sequence[int]) -> list[bytes]:
        """Extend `hashes` to every full block of `token_ids` (all known ids of the request)."""
        bs = self.block_size
        for index in range(len(self.hashes), len(token_ids) // bs):
            parent = self.hashes[-1] if self.hashes else None
            self.hashes.append(hash_block(parent, token_ids[index * bs:(index + 1) * bs], self.extra_keys(index)))
        return self.hashes
