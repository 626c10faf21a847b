"""Give large freed buffers back to the OS at once (glibc's malloc).

glibc serves an allocation from its heap instead of a private mapping once a freed mapping raised
its dynamic mmap threshold (up to 32 MiB), and a heap keeps freed memory for reuse: after a few
refused multi-MB requests a process holds several request sizes of memory while idle. A fixed
threshold maps every larger buffer privately and unmaps it when freed. Worth it where buffers are
messages, not tensors: a tensor op above the threshold would pay a fresh mapping every time.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
MIB = 1 << 20


def unmap_large_buffers(threshold_bytes: int = MIB) -> bool:
    """Fix glibc's mmap threshold at `threshold_bytes`; False where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt; large buffers follow the allocator's defaults")
        return False
    return mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1
