"""Byte sizes on the command line: "1073741824", "2GiB", "512MB", "1.5GiB".

Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of
1000, as Kubernetes' quantities (`Gi`, `G`) and vLLM's `--kv-cache-memory-bytes` read them; a bare
number is bytes. Case and a space before the suffix do not matter; `Ki`/`Mi`/`Gi`/`Ti` (Kubernetes'
spelling) are accepted too.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """`text` as a whole number of bytes (fractions of a suffix round down: "1.5KiB" = 1536).

    Raises:
        ValueError: not a number with one of the suffixes above (the message names the text).
    """
    match = _SIZE.fullmatch(str(text))
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        raise ValueError(f"{text!r} is not a size in bytes: a number, optionally with KiB, MiB, GiB, TiB "
                         "(powers of 1024) or KB, MB, GB, TB (powers of 1000)")
    return int(float(match.group(1)) * unit) if "." in match.group(1) else int(match.group(1)) * unit


def format_bytes(count: int) -> str:
    """`count` bytes for a message: "1048576 bytes (1.0 MiB)"."""
    for suffix, unit in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= unit:
            return f"{count} bytes ({count / unit:.1f} {suffix})"
    return f"{count} bytes"
