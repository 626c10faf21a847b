"""Give freed request buffers back to the OS at once (glibc's malloc), for processes that relay
messages rather than compute tensors (the gateway); and give back the file pages of checkpoint
tensors a loader copied and dropped (`release_file_pages`).

glibc keeps freed memory for reuse: in one heap per thread that allocated it (up to 8 per core)
and, once a freed mapping has raised its dynamic mmap threshold (up to 32 MiB), in the heaps for
buffers of that size too. After a few refused multi-MB requests a relay holds several request sizes
of memory while idle. One heap and a fixed threshold map every larger buffer privately and unmap it
when freed, and leave little room for idle memory between them. A tensor-computing service would
pay a fresh mapping for every large op, so only the gateway asks for this.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable
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


def _file_mappings() -> list[tuple[int, int]]:
    """[(start, end)] of this process's memory mappings backed by a file (/proc/self/maps)."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/") and int(fields[4]):  # an inode: a file
                start, end = fields[0].split("-")
                spans.append((int(start, 16), int(end, 16)))
    return spans


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
