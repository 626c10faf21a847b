"""Give freed request buffers back to the OS at once (glibc's malloc), for processes that relay
messages rather than compute tensors (the gateway).

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
