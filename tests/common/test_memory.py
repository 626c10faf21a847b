"""`release_file_pages` (services/common/memory.py): the file pages of checkpoint tensors a loader
copied and dropped leave the resident set; anything that is not such a tensor is left alone."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from services.common.memory import release_file_pages

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
