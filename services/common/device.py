"""`--device auto|cpu|cuda[:N]`: the one reading of a service's device setting, checked at start.

"auto" is CUDA device 0 when torch sees a GPU, else the CPU. "cuda" is the current CUDA device
(0 unless CUDA_VISIBLE_DEVICES reorders them); "cuda:N" needs N below torch's device count.
torch is imported when a device is resolved, not when this module is, so a client command that
only lists the flag loads no torch.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_HELP = "where the model computes: auto (CUDA when torch sees a GPU, else cpu), cpu, cuda or cuda:N"
_DEVICE = re.compile(r"(auto|cpu|cuda)(?::(\d+))?")


def resolve_device(spec: str, flag: str = "--device") -> torch.device:
    """The torch device `spec` names, on this machine.

    Raises:
        ValueError: naming `flag` and the value: a spelling other than auto, cpu, cuda, cuda:N;
            "cuda" where torch sees no CUDA device; "cuda:N" past the device count.
    """
    import torch

    match = _DEVICE.fullmatch(spec.strip().lower())
    if match is None or (match[2] is not None and match[1] != "cuda"):
        raise ValueError(f"{flag} {spec!r} is not a device; expected auto, cpu, cuda or cuda:N")
    kind, index = match[1], match[2]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "auto":
        return torch.device("cuda", 0) if count else torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if count == 0:
        raise ValueError(f"{flag} {spec} needs a CUDA device; torch sees none on this machine "
                         f"(torch.cuda.is_available() is False); use --device cpu or auto")
    number = torch.cuda.current_device() if index is None else int(index)
    if number >= count:
        raise ValueError(f"{flag} {spec}: this machine has {count} CUDA device{'s' * (count > 1)} "
                         f"(cuda:0..cuda:{count - 1})")
    return torch.device("cuda", number)
