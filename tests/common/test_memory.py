"""services/common/memory.py: `release_file_pages` (the file pages of checkpoint tensors a loader
copied and dropped leave the resident set; anything that is not such a tensor is left alone) and
`back_with_huge_pages` (a tensor's bytes move into huge pages with their values; nothing outside
the tensors is touched) and `advise_huge_pages` (memory marked before it is written faults in as
huge pages)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch
from safetensors.torch import load_file, save_file

from services.common.memory import (
    THP_ENABLED,
    THP_SIZE,
    advise_huge_pages,
    back_with_huge_pages,
    release_file_pages,
)

MIB = 1 << 20


def _resident_kb(path) -> int:
    """Rss of this process's mappings of `path`, in KiB (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = len(fields) == 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_released_pages_leave_the_resident_set_and_fault_back_from_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    expected = {"a": torch.arange(4 * MIB // 4, dtype=torch.float32), "b": torch.full((2 * MIB // 4,), 3.0)}
    save_file(expected, path)
    state = load_file(path)
    assert float(state["a"].sum()) and float(state["b"].sum())  # every page read once
    before = _resident_kb(path)
    assert before >= 6 * 1024
    released = release_file_pages([state["a"]])
    assert 4 * MIB - 2 * 4096 <= released <= 4 * MIB  # the pages wholly inside the tensor
    assert _resident_kb(path) <= before - 4 * 1024 + 8
    assert torch.equal(state["a"], expected["a"]) and torch.equal(state["b"], expected["b"])  # read again


def test_tensors_that_are_not_whole_file_views_are_left_alone():
    anonymous = torch.ones(2 * MIB // 4)
    parent = torch.ones(4 * MIB // 4)
    assert release_file_pages([anonymous, parent[MIB // 4:]]) == 0  # not a file mapping; a view of a storage
    assert bool((anonymous == 1).all()) and bool((parent == 1).all())


def _collapses_here() -> bool:
    """Linux >= 6.1 (MADV_COLLAPSE) with transparent huge pages not "never"."""
    if not sys.platform.startswith("linux") or not THP_ENABLED.exists() or "[never]" in THP_ENABLED.read_text():
        return False
    major, minor = (int(v) for v in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 1)


def _kb(low: int, high: int, field: str) -> int:
    """`field` (Rss:, AnonHugePages:) of the mappings overlapping [low, high), in KiB (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                start, end = (int(v, 16) for v in fields[0].split("-"))
                inside = start < high and low < end
            elif inside and fields[0] == field:
                total += int(fields[1])
    return total


def test_a_tensor_moves_into_huge_pages_with_its_values():
    tensor = torch.arange(16 * MIB // 4, dtype=torch.float32)
    expected = tensor.clone()
    low, high = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    huge = int(THP_SIZE.read_text()) if THP_SIZE.exists() else 2 * MIB
    blocks = (high // huge) - (-(-low // huge))  # whole huge pages inside the tensor's bytes
    collapsed = back_with_huge_pages([tensor])
    if not _collapses_here():
        assert collapsed == 0
        return
    assert collapsed == blocks * huge >= 14 * MIB
    assert _kb(low, high, "AnonHugePages:") >= collapsed // 1024
    assert torch.equal(tensor, expected)
    assert back_with_huge_pages([tensor]) == collapsed  # again: nothing to copy, the same blocks


def _resident(low: int, high: int) -> int:
    """Bytes of the pages in [low, high) present in memory (mincore: this range only, whatever
    mapping it shares with other allocations)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = low // page * page
    pages = (high - start + page - 1) // page
    present = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(start, pages * page, present) == 0, ctypes.get_errno()
    return sum(p & 1 for p in present) * page


def test_only_the_tensors_own_bytes_are_backed():
    """A view of part of a storage: the rest of the storage, never written, gains no resident page."""
    fresh = mmap.mmap(-1, 64 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # a new mapping, as below
    storage = torch.frombuffer(fresh, dtype=torch.uint8)  # not written: its pages are not present
    view = storage[8 * MIB:16 * MIB]
    view.fill_(7)
    low, high = storage.data_ptr(), storage.data_ptr() + storage.nbytes
    resident = _resident(low, high)
    assert 8 * MIB <= resident < 9 * MIB
    collapsed = back_with_huge_pages([view])
    assert collapsed <= 8 * MIB and (collapsed >= 6 * MIB or not _collapses_here())
    assert _resident(low, high) == resident
    assert bool((view == 7).all())
    assert back_with_huge_pages([torch.ones(3, device="meta")]) == 0  # not CPU memory: left alone


def test_memory_advised_before_it_is_written_faults_in_as_huge_pages():
    # a new mapping: malloc may serve even 64 MB from memory freed earlier in the process, already
    # faulted in 4 KiB pages (a clean-clone .ci/run's pytest process did: AnonHugePages 0 kB)
    fresh = mmap.mmap(-1, 64 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(fresh, dtype=torch.uint8)
    low, high = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    advised = advise_huge_pages(tensor)
    tensor.fill_(1)
    if not sys.platform.startswith("linux") or "[never]" in THP_ENABLED.read_text():
        assert advised == 0
        return
    assert advised >= 62 * MIB
    assert _kb(low, high, "AnonHugePages:") >= 48 * 1024  # a fault may still fall back to 4 KiB pages
    assert advise_huge_pages(torch.ones(3, device="meta")) == 0
