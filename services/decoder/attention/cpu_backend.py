"""The cpu attention backend: decode rows in the C kernel (kernels/paged_attention.c, called through
ctypes), prefill spans in another (kernels/prefill_attention.c: flash attention over the paged cache,
`paged_prefill_attention`); each step's K/V written into the cache by a C loop too (`write_kv`:
KVCache.write's result, 2-3x faster here).

The torch path gathers each decode row's K/V blocks into padded groups and runs two batched
matmuls on the copy; this kernel reads every K and V row once, straight from its
block, and never pads: on the 2-core CI machine, 32 rows x 150-700 positions, one SmolLM2 layer
took 4.8 ms on the torch path and 1.6 ms here (float32, same results within 2e-7).

The kernel is built with the C compiler (kernels/native.py) when the backend is constructed, and
runs on the calling thread's OpenMP team with torch's thread count. float32 or bfloat16 (bf16
query and cache, float32 scores, softmax and sums, as the torch path computes half precision;
AVX512-BF16 dot products where the CPU has them), or a float32 model over a bfloat16 cache
(--kv-cache-dtype bfloat16: K/V rounded as they are written, widened exactly as they are read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

import torch

from services.decoder.attention.backend import AttentionBackend, AttentionMetadata, check_attention_options
from services.decoder.attention.torch_backend import PrefillSpan, split_batch
from services.decoder.block_manager import padded_block_tables
from services.decoder.kernels import native

if TYPE_CHECKING:
    from services.decoder.kv_cache import KVCache
    from services.decoder.scheduler import ScheduledRequest


# (query or key/value dtype, cache dtype) -> kernel; a float32 model over a bfloat16 cache is --kv-cache-dtype bfloat16
_KERNELS = {(torch.float32, torch.float32): "tessera_paged_decode_attention_f32",
            (torch.bfloat16, torch.bfloat16): "tessera_paged_decode_attention_bf16",
            (torch.float32, torch.bfloat16): "tessera_paged_decode_attention_f32_bf16kv"}
_PREFILL_KERNELS = {(torch.float32, torch.float32): "tessera_paged_prefill_attention_f32",
                    (torch.bfloat16, torch.bfloat16): "tessera_paged_prefill_attention_bf16",
                    (torch.float32, torch.bfloat16): "tessera_paged_prefill_attention_f32_bf16kv"}
_WRITE_KERNELS = {(torch.float32, torch.float32): "tessera_write_kv_f32",
                  (torch.bfloat16, torch.bfloat16): "tessera_write_kv_bf16",
                  (torch.float32, torch.bfloat16): "tessera_write_kv_f32_bf16kv"}


@dataclass
class CpuDecodeMetadata:
    """Decode rows for the kernel: rows int64 [n] (flat-batch rows), block_tables int32 [n, width]
    (padded with block 0, never read past context_lens), context_lens int32 [n] (>= 1)."""

    rows: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    max_context: int
    # (least, greatest) of context_lens where the caller built them from ints: checked without tensor ops
    lens_bounds: InitVar[tuple[int, int] | None] = None

    def __post_init__(self, lens_bounds: tuple[int, int] | None) -> None:
        """The kernel trusts these (it sizes its score buffers by max_context); checked once per step."""
        n = self.rows.numel()
        if (self.rows.dtype != torch.long or self.block_tables.dtype != torch.int32
                or self.context_lens.dtype != torch.int32 or not self.block_tables.is_contiguous()
                or self.block_tables.shape[0] != n or self.context_lens.shape != (n,)):
            raise ValueError("CpuDecodeMetadata: rows int64 [n], block_tables int32 [n, width] contiguous, "
                             "context_lens int32 [n]")
        if n and lens_bounds is None:
            lens_bounds = int(self.context_lens.min()), int(self.context_lens.max())
        if n and (lens_bounds[0] < 1 or lens_bounds[1] > self.max_context):
            raise ValueError(f"CpuDecodeMetadata: context_lens must lie in [1, max_context={self.max_context}]")


@dataclass
class CpuPrefillMetadata:
    """Prefill spans for the kernel: spans int64 [n, 4] (first flat-batch row, query rows, position of
    the first query row, offset of the span's context in `slots`), slots int64 [sum of context
    lengths]: each span's cache slots of positions 0 .. its last query's, concatenated."""

    spans: torch.Tensor
    slots: torch.Tensor
    rows_end: int = field(init=False)  # one past the last query row of any span

    def __post_init__(self) -> None:
        """The kernel trusts these; checked once per step (the backend's forward runs once per layer)."""
        spans, slots = self.spans, self.slots
        if (spans.dtype != torch.long or slots.dtype != torch.long or spans.dim() != 2 or spans.shape[1] != 4
                or slots.dim() != 1 or not spans.is_contiguous() or not slots.is_contiguous()):
            raise ValueError("CpuPrefillMetadata: spans int64 [n, 4] and slots int64 [total], contiguous")
        self.rows_end = 0
        if spans.numel():
            starts, lengths, computed, offsets = spans.unbind(1)
            if (int(starts.min()) < 0 or int(lengths.min()) < 1 or int(computed.min()) < 0 or int(offsets.min()) < 0
                    or int((offsets + computed + lengths).max()) > slots.numel()):
                raise ValueError(f"CpuPrefillMetadata: spans outside their rows or the {slots.numel()} slots")
            self.rows_end = int((starts + lengths).max())

    @classmethod
    def of(cls, prefills: Sequence[PrefillSpan]) -> CpuPrefillMetadata:
        rows, offset = [], 0
        for span in prefills:
            rows.append((span.token_start, span.token_end - span.token_start, span.num_computed, offset))
            offset += span.context_slots.numel()
        return cls(torch.tensor(rows, dtype=torch.long).reshape(-1, 4),
                   torch.cat([span.context_slots for span in prefills]).to(torch.long))


@dataclass(kw_only=True)
class CpuAttentionMetadata(AttentionMetadata):
    """The cpu backend's step: the prefill kernel's spans and the decode kernel's rows (None: none)."""

    prefills: list[PrefillSpan] = field(default_factory=list)
    prefill: CpuPrefillMetadata | None = None
    decode: CpuDecodeMetadata | None = None
    block_size: int = 0


class CpuAttentionBackend(AttentionBackend[CpuAttentionMetadata]):
    """Decode rows and prefill spans in C kernels over the paged cache."""

    name = "cpu"

    @classmethod
    def check_config(cls, block_size: int, dtype: str) -> None:
        if dtype not in native.DTYPES:
            raise ValueError(f"the cpu attention backend computes {' and '.join(native.DTYPES)} only, "
                             f"got dtype {dtype!r}")

    def __init__(self) -> None:
        """Builds the kernel now, so a missing compiler fails at start, not mid-request.

        Raises:
            ValueError: no working C compiler with OpenMP and glibc's libmvec, or the built library
                cannot be loaded (the message names the command, its exit code and output).
        """
        try:
            native.load()
        except RuntimeError as exc:
            raise ValueError(f"attention_backend 'cpu' cannot run here: {exc}") from exc

    def build_metadata(self, scheduled: Sequence[ScheduledRequest], block_tables: Sequence[Sequence[int]],
                       cache: KVCache) -> CpuAttentionMetadata:
        batch = split_batch(scheduled, block_tables, cache.block_size)
        slots = batch.slot_mapping
        bounds = batch.slot_bounds  # the C write trusts the slots: a decode step's from its ints, else one op
        if bounds is None and slots.numel():
            least, greatest = torch.aminmax(slots)
            bounds = int(least), int(greatest)
        if bounds is not None and (bounds[0] < 0 or bounds[1] >= cache.num_slots):
            raise ValueError(f"slot mapping outside the cache's {cache.num_slots} slots")
        meta = CpuAttentionMetadata(slot_mapping=slots, prefills=batch.prefills)  # write_kv reads the slots
        if batch.prefills:
            meta.prefill = CpuPrefillMetadata.of(batch.prefills)
        if batch.decode_rows:
            meta.block_size = cache.block_size
            meta.decode = decode_metadata(batch.decode_rows, batch.decode_tables, batch.decode_lens, cache.block_size)
        return meta

    def write_kv(self, cache: KVCache, layer: int, key: torch.Tensor, value: torch.Tensor,
                 meta: CpuAttentionMetadata) -> None:
        """KVCache.write's result in one C pass (no transposed copies, no index tensors)."""
        k_cache, v_cache = cache.layer(layer)
        write_kv(key, value, meta.slot_mapping, k_cache, v_cache)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: CpuAttentionMetadata, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        check_attention_options(sliding_window, logits_soft_cap)
        out = torch.empty_like(query)
        if meta.prefill is not None:
            paged_prefill_attention(query, k_cache, v_cache, meta.prefill, scale, out, sliding_window, logits_soft_cap)
        if meta.decode is not None:
            paged_decode_attention(query, k_cache, v_cache, meta.decode, meta.block_size, scale, out,
                                   sliding_window, logits_soft_cap)
        return out


def decode_metadata(rows: list[int], block_tables: Sequence[Sequence[int]], context_lens: list[int],
                    block_size: int) -> CpuDecodeMetadata:
    """Kernel inputs for decode `rows` whose contexts are positions [0, context_lens[i]) in blocks
    `block_tables[i]` (at least ceil(len / block_size) ids each)."""
    tables = padded_block_tables([table[:-(-n // block_size)] for table, n in zip(block_tables, context_lens)])
    return CpuDecodeMetadata(torch.tensor(rows, dtype=torch.long), tables,
                             torch.tensor(context_lens, dtype=torch.int32), max(context_lens),
                             (min(context_lens), max(context_lens)))


def _attention_kernel(kernels: dict, what: str, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor) -> str:
    """The name of the kernel in `kernels` for these dtypes; ValueError naming them when there is none
    or a tensor is not contiguous."""
    kernel = kernels.get((query.dtype, k_cache.dtype))
    if (kernel is None or out.dtype != query.dtype or v_cache.dtype != k_cache.dtype
            or not all(t.is_contiguous() for t in (query, k_cache, v_cache, out))):
        raise ValueError(f"the cpu {what} kernel takes contiguous query, caches and output, all float32, all "
                         f"bfloat16, or a float32 query over bfloat16 caches; got query {query.dtype}, caches "
                         f"{k_cache.dtype}/{v_cache.dtype}, output {out.dtype}")
    return kernel


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: CpuDecodeMetadata, block_size: int, scale: float, out: torch.Tensor,
                           sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
    """Write the decode rows' attention into `out` (see kernels/paged_attention.c); `sliding_window`
    and `logits_soft_cap` as `AttentionBackend.forward` states them (the kernel reads no position
    before a row's window).

    query/out: [num_tokens, heads, head_dim], contiguous (only `meta.rows` of `out` are written);
    k_cache/v_cache: [kv_heads, num_slots, head_dim], contiguous, head-major; all four float32, all
    four bfloat16, or float32 query and output over bfloat16 caches (--kv-cache-dtype bfloat16).

    Raises:
        ValueError: another pairing of dtypes, a non-contiguous tensor, heads not a multiple of kv heads, a cache
            whose head_dim differs, or block tables too narrow for max_context. (Block ids are
            trusted: `decode_metadata` takes them from the block manager.)
        RuntimeError: the kernel could not allocate its score buffers.
    """
    kernel = _attention_kernel(_KERNELS, "attention", query, k_cache, v_cache, out)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, num_slots, cache_head_dim = k_cache.shape
    rows, tables, lens = meta.rows, meta.block_tables, meta.context_lens
    if (num_heads % num_kv_heads or cache_head_dim != head_dim or out.shape != query.shape
            or v_cache.shape != k_cache.shape or num_slots % block_size
            or tables.shape[1] * block_size < meta.max_context):
        raise ValueError(f"shapes do not fit: query {tuple(query.shape)}, cache {tuple(k_cache.shape)}, "
                         f"block tables {tuple(tables.shape)} x block_size {block_size}")
    rc = getattr(native.load(), kernel)(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), rows.data_ptr(), tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), out.data_ptr(), rows.numel(), num_heads, num_kv_heads, head_dim,
        num_slots, block_size, meta.max_context, scale, sliding_window or 0, logits_soft_cap or 0.0,
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("the cpu attention kernel could not allocate its score buffers")


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: CpuPrefillMetadata, scale: float, out: torch.Tensor,
                            sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
    """Write the prefill spans' attention into `out` (kernels/prefill_attention.c): query row i of a
    span attends to positions num_computed + i - sliding_window < t <= num_computed + i of its context
    (causal; the window's bound only with one), scores capped with `logits_soft_cap` when given, as
    SDPA / transformers' eager attention compute them (float32 scores and sums).

    query/out: [num_tokens, heads, head_dim], contiguous (only the spans' rows of `out` are written);
    k_cache/v_cache: [kv_heads, num_slots, head_dim], contiguous, head-major; dtypes as
    `paged_decode_attention` takes them. The slots are trusted (the block manager's, as the decode
    kernel's block tables).

    Raises:
        ValueError: another pairing of dtypes, a non-contiguous tensor, heads not a multiple of kv heads,
            a cache whose head_dim differs, or spans past `query`'s rows (`CpuPrefillMetadata` checks
            them against its slots once per step).
        RuntimeError: the kernel could not allocate its buffers.
    """
    kernel = _attention_kernel(_PREFILL_KERNELS, "prefill attention", query, k_cache, v_cache, out)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, num_slots, cache_head_dim = k_cache.shape
    spans, slots = meta.spans, meta.slots
    if num_heads % num_kv_heads or cache_head_dim != head_dim or out.shape != query.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"shapes do not fit: query {tuple(query.shape)}, cache {tuple(k_cache.shape)}")
    if meta.rows_end > num_tokens:
        raise ValueError(f"prefill spans reach row {meta.rows_end}, past the {num_tokens} query rows")
    rc = getattr(native.load(), kernel)(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), spans.data_ptr(), spans.shape[0], slots.data_ptr(),
        out.data_ptr(), num_heads, num_kv_heads, head_dim, num_slots, scale, sliding_window or 0,
        logits_soft_cap or 0.0, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("the cpu prefill attention kernel could not allocate its buffers")


def write_kv(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor) -> None:
    """Store key/value [num_tokens, kv_heads, head_dim] at cache slots `slot_mapping` (int64 [num_tokens],
    each in [0, num_slots), trusted: `build_metadata` checks them once per step) of k_cache/v_cache
    [kv_heads, num_slots, head_dim]; non-finite V values are stored as 0, as `KVCache.write` does
    (kernels/paged_attention.c). key and value may be row views (each head's values contiguous, heads
    adjacent), as the fused projection's k and v are; all four float32, all four bfloat16, or float32
    key and value rounded into bfloat16 caches (to nearest even, as `.to(torch.bfloat16)`).

    Raises:
        ValueError: another pairing of dtypes, non-contiguous caches, or shapes that do not fit.
    """
    tensors = (key, value, k_cache, v_cache)
    kernel = _WRITE_KERNELS.get((key.dtype, k_cache.dtype))
    if (kernel is None or value.dtype != key.dtype or v_cache.dtype != k_cache.dtype
            or any(t.device.type != "cpu" for t in tensors)):
        raise ValueError(f"the cpu KV write takes key, value and caches on the CPU, all float32, all bfloat16, or "
                         f"float32 key/value into bfloat16 caches; got {key.dtype}/{value.dtype} into "
                         f"{k_cache.dtype}/{v_cache.dtype}")
    num_kv_heads, num_slots, head_dim = k_cache.shape
    tokens = key.shape[0]
    if (key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape
            or v_cache.shape != k_cache.shape or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or slot_mapping.shape != (tokens,) or slot_mapping.dtype != torch.long):
        raise ValueError(f"shapes do not fit: key {tuple(key.shape)}, value {tuple(value.shape)}, cache "
                         f"{tuple(k_cache.shape)}, slot mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype}")

    def rows(x: torch.Tensor) -> torch.Tensor:  # heads adjacent and contiguous within a token's row
        if x.stride(2) == 1 and x.stride(1) == head_dim and (tokens < 2 or x.stride(0) >= num_kv_heads * head_dim):
            return x
        return x.contiguous()

    key, value, slot_mapping = rows(key), rows(value), slot_mapping.contiguous()
    if tokens:
        getattr(native.load(), kernel)(
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slot_mapping.data_ptr(), tokens,
            num_kv_heads, head_dim, num_slots, k_cache.data_ptr(), v_cache.data_ptr())
