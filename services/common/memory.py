"""Give freed request buffers back to the OS at once (glibc's malloc), for processes that relay
messages rather than compute tensors (the gateway); give back the file pages of checkpoint
tensors a loader copied and dropped (`release_file_pages`); and back the tensors a step streams
(weights, KV cache, LoRA slots) with transparent huge pages (`back_with_huge_pages`).

glibc keeps freed memory for reuse: in one heap per thread that allocated it (up to 8 per core)
and, once a freed mapping has raised its dynamic mmap threshold (up to 32 MiB), in the heaps for
buffers of that size too. After a few refused multi-MB requests a relay holds several request sizes
of memory while idle. One heap and a fixed threshold map every larger buffer privately and unmap it
when freed, and leave little room for idle memory between them. A tensor-computing service would
pay a fresh mapping for every large op, so only the gateway asks for this.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the gateway imports this module without torch
    import torch

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
M_ARENA_MAX = -8
DEFAULT_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, kept fixed


def unmap_large_buffers(threshold_bytes: int = DEFAULT_THRESHOLD_BYTES) -> bool:
    """One malloc heap and a fixed mmap threshold of `threshold_bytes`; False where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt; freed buffers follow the allocator's defaults")
        return False
    return mallopt(M_ARENA_MAX, 1) == 1 and mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1


MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def _mappings(keep) -> list[tuple[int, int]]:
    """[(start, end)] of this process's memory mappings whose /proc/self/maps fields `keep` accepts."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if keep(fields):
                start, end = fields[0].split("-")
                spans.append((int(start, 16), int(end, 16)))
    return spans


def _file_mappings() -> list[tuple[int, int]]:
    """[(start, end)] of this process's memory mappings backed by a file (/proc/self/maps)."""
    return _mappings(lambda f: len(f) == 6 and f[5].startswith("/") and int(f[4]))  # an inode: a file


def release_file_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Give the kernel back the resident pages of `tensors` that a loader has copied (fused, converted)
    and drops: safetensors' `load_file` maps the checkpoint file privately, each tensor a view of it,
    and a page read once stays in the process's resident set for as long as the mapping lives,
    which is as long as any tensor of the file does. Only pages wholly inside a tensor whose storage
    is the tensor itself and which lies in a file mapping are released (madvise MADV_DONTNEED: a later
    read faults them in again from the file; pages the process wrote, copy-on-write, would be lost,
    hence only for tensors the caller drops); anything else is left alone. Returns the bytes
    released (0 off Linux).
    """
    if not sys.platform.startswith("linux"):
        return 0
    page, spans, released = os.sysconf("SC_PAGE_SIZE"), None, 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if tensor.device.type != "cpu" or storage.nbytes() != tensor.nbytes or tensor.data_ptr() != storage.data_ptr():
            continue
        start = -(-tensor.data_ptr() // page) * page
        end = (tensor.data_ptr() + tensor.nbytes) // page * page
        if end <= start:
            continue
        spans = spans if spans is not None else _file_mappings()
        if not any(low <= start and end <= high for low, high in spans):
            continue
        if madvise(start, end - start, MADV_DONTNEED) == 0:
            released += end - start
    return released


MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
MADV_COLLAPSE = 25  # Linux 6.1
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
SPAN_GAP_BYTES = 1 << 16  # tensors closer than this are one span (allocator headers and page tails between)


def _anonymous_mappings() -> list[tuple[int, int]]:
    """[(start, end)] of this process's private writable mappings backed by no file (/proc/self/maps)."""
    return _mappings(lambda f: f[1].startswith("rw") and f[1][3] == "p" and (len(f) < 6 or f[5].strip() == "[heap]"))


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes `tensor` covers (a view: only its own elements' range, not its storage's)."""
    last = sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    low = tensor.data_ptr() - tensor.element_size() * sum(
        (size - 1) * -stride for size, stride in zip(tensor.shape, tensor.stride()) if stride < 0)
    return low, low + (last + 1) * tensor.element_size()


def _huge_page_bytes() -> int:
    """The transparent huge page size (2 MiB on x86-64); 0 where there are none (off Linux, THP "never")."""
    if not sys.platform.startswith("linux") or not THP_ENABLED.exists() or "[never]" in THP_ENABLED.read_text():
        return 0
    return int(THP_SIZE.read_text()) if THP_SIZE.exists() else 2 << 20


def _madvise():
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Mark the whole huge-page blocks inside a CPU tensor's bytes MADV_HUGEPAGE before they are first
    written: the page faults that then populate them take huge pages, no copy (unlike
    `back_with_huge_pages`; 256 MiB zeroed in a fresh process on a 2-core VM: 13 ms, 4 KiB pages 53
    ms, and several times longer where the kernel first compacts memory for free huge pages). Memory
    already written keeps its pages. Returns the bytes marked (0 off Linux, with THP "never", or for
    another device)."""
    huge = _huge_page_bytes()
    if not huge or tensor.device.type != "cpu" or not tensor.numel():
        return 0
    start, end = _extent(tensor)
    first, last = -(-start // huge) * huge, end // huge * huge
    return max(last - first, 0) if last > first and _madvise()(first, last - first, MADV_HUGEPAGE) == 0 else 0


def back_with_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Back the CPU tensors' memory with transparent huge pages (2 MiB on x86-64) where the kernel
    allows it; returns the bytes now in huge pages (0 off Linux, with THP "never", or before Linux
    6.1, which has no MADV_COLLAPSE).

    A decode step streams every weight once, and the LoRA and KV bytes it reads, from memory: with
    4 KiB pages that is a TLB miss every 4 KiB (SmolLM2-135M bf16: ~90,000 a step, weights, KV cache
    and 8 adapters' slots), with huge pages one every 2 MiB. glibc gives each large allocation its
    own 4 KiB-aligned mapping and the usual THP mode ("madvise") leaves them in 4 KiB pages, so each
    huge-page-sized block wholly inside a span of the tensors (the bytes each covers; tensors less
    than SPAN_GAP_BYTES apart are one span) and inside an anonymous private mapping is marked
    MADV_HUGEPAGE and collapsed at once (MADV_COLLAPSE copies the contents into a huge page and
    populates any page of the block not present, so only blocks inside the tensors' own bytes).
    Memory outside the spans is left alone (the rest of a storage a view covers part of, an idle
    thread's stack), and so are file mappings (a checkpoint tensor still a view of its file). A
    block the kernel refuses (no free huge page, a mapping boundary; before 6.1 khugepaged may
    collapse the marked blocks later) stays as it is; nothing raises. Collapsing copies each block
    and may compact memory first: 0.4-3 GB/s on a 2-core VM.
    """
    huge = _huge_page_bytes()
    if not huge:
        return 0
    spans: list[list[int]] = []
    for start, end in sorted(_extent(t) for t in tensors if t.device.type == "cpu" and t.numel()):
        if spans and start - spans[-1][1] < SPAN_GAP_BYTES:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    madvise, mappings, collapsed = _madvise(), sorted(_anonymous_mappings()), 0
    for start, end in spans:
        for low, high in mappings[max(bisect.bisect_right(mappings, (start, start)) - 1, 0):]:
            if low >= end:
                break
            first, last = -(-max(start, low) // huge) * huge, min(end, high) // huge * huge
            for block in range(first, last, huge):
                if madvise(block, huge, MADV_HUGEPAGE) == 0 and madvise(block, huge, MADV_COLLAPSE) == 0:
                    collapsed += huge
    return collapsed
