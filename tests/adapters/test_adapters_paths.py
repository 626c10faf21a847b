"""Client paths stay inside the adapter root: `..`, absolute, symlink and URL escapes are refused,
also while a symlink inside the root is swapped during the loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest

from services.adapters.config import RegistryConfig
from services.adapters.engine import AdapterRegistry
from services.adapters.paths import open_in_root
from services.adapters.peft_format import read_peft_adapter
from services.common.errors import InvalidArgument, NotFound
from services.common.names import check_adapter_name


def resolve_in_root(root, path):
    """The absolute directory `path` opens to (its descriptor closed again)."""
    with open_in_root(root, path) as directory:
        return directory.display


def test_relative_and_absolute_inside_resolve_to_the_same_dir(root, adapter_in_root):
    assert resolve_in_root(root, "plain") == adapter_in_root.resolve()
    assert resolve_in_root(root, str(adapter_in_root)) == adapter_in_root.resolve()
    assert resolve_in_root(root, "sub/../plain") == adapter_in_root.resolve()
    with open_in_root(root, "./plain/") as directory:
        assert directory.path == "plain"


def test_dotdot_escape_is_refused(root, tmp_path, plain_adapter):
    shutil.copytree(plain_adapter[0], tmp_path / "outside")
    with pytest.raises(InvalidArgument, match="resolves outside the adapter root"):
        resolve_in_root(root, "../outside")


def test_absolute_path_outside_is_refused(root, plain_adapter):
    with pytest.raises(InvalidArgument, match="resolves outside the adapter root"):
        resolve_in_root(root, str(plain_adapter[0]))


def test_symlinked_dir_pointing_out_is_refused(root, plain_adapter):
    (root / "sneaky").symlink_to(plain_adapter[0], target_is_directory=True)
    with pytest.raises(InvalidArgument, match="resolves outside the adapter root"):
        resolve_in_root(root, "sneaky")


def test_symlinked_weights_file_pointing_out_is_refused(root, adapter_in_root, plain_adapter):
    weights = adapter_in_root / "adapter_model.safetensors"
    weights.unlink()
    weights.symlink_to(plain_adapter[0] / "adapter_model.safetensors")
    resolve_in_root(root, "plain")  # the directory itself is inside
    with pytest.raises(InvalidArgument, match="adapter_model.safetensors .*resolves outside the adapter root"):
        read_peft_adapter("plain", root, "x", 64)


def test_missing_dir_is_not_found_and_file_is_invalid(root, adapter_in_root):
    with pytest.raises(NotFound, match="does not exist"):
        resolve_in_root(root, "nope")
    with pytest.raises(InvalidArgument, match="not a directory"):
        resolve_in_root(root, "plain/adapter_config.json")
    (adapter_in_root / "adapter_model.safetensors").unlink()
    with pytest.raises(InvalidArgument, match="adapter_model.safetensors is missing"):
        read_peft_adapter(adapter_in_root, root, "x", 64)


@pytest.mark.parametrize("url", ["https://huggingface.co/org/lora", "s3://bucket/lora", "hf://org/lora"])
def test_remote_urls_are_refused(root, url):
    with pytest.raises(InvalidArgument, match="remote URL"):
        resolve_in_root(root, url)


def test_empty_path_and_bad_names_are_refused(root):
    with pytest.raises(InvalidArgument, match="empty"):
        resolve_in_root(root, "")
    for name in ["", "../x", "a/b", "-x", "x" * 129, "sp ace"]:
        with pytest.raises(InvalidArgument, match="adapter name"):
            check_adapter_name(name)
    assert check_adapter_name("support-v2.1_a") == "support-v2.1_a"


def test_symlinks_that_stay_inside_are_followed(root, adapter_in_root, plain_adapter):
    (root / "relative").symlink_to("plain", target_is_directory=True)
    (root / "absolute").symlink_to(adapter_in_root.resolve(), target_is_directory=True)
    (root / "nested").mkdir()
    (root / "nested" / "up").symlink_to("../plain", target_is_directory=True)
    for path in ("relative", "absolute", "nested/up"):
        with open_in_root(root, path) as directory:
            assert directory.path == "plain"  # the catalog keeps where the files are
    weights = adapter_in_root / "adapter_model.safetensors"
    weights.rename(root / "weights.safetensors")
    weights.symlink_to("../weights.safetensors")
    expected = read_peft_adapter(plain_adapter[0], plain_adapter[0].parent, "x", 64)
    assert read_peft_adapter("plain", root, "x", 64).digest == expected.digest


def test_symlinks_leading_out_by_dotdot_or_looping_are_refused(root, tmp_path, plain_adapter):
    shutil.copytree(plain_adapter[0], tmp_path / "outside")
    (root / "up").symlink_to("../outside", target_is_directory=True)
    with pytest.raises(InvalidArgument, match="resolves outside the adapter root"):
        open_in_root(root, "up")
    (root / "loop").symlink_to("loop")
    with pytest.raises(InvalidArgument, match="not usable"):
        open_in_root(root, "loop")


def test_a_fifo_for_a_file_is_refused_without_waiting(root, adapter_in_root):
    weights = adapter_in_root / "adapter_model.safetensors"
    weights.unlink()
    os.mkfifo(weights)
    with pytest.raises(InvalidArgument, match="adapter_model.safetensors is missing .not a regular file"):
        read_peft_adapter("plain", root, "x", 64)


def test_no_load_reads_outside_the_root_while_a_symlink_is_swapped(root, adapter_in_root, tmp_path, make_adapter,
                                                                   base_model_dir):
    """A thread flips root/swap between a directory inside the root and one outside during 200
    loads: each load either reads the inside adapter or is refused, never the outside one."""
    make_adapter(tmp_path / "outside", seed=1)  # other weights: another digest
    registry = AdapterRegistry(RegistryConfig(root=root, admin_token="", base_model_dir=base_model_dir))
    inside = registry.load("inside", "plain").digest
    outside_dir = (tmp_path / "outside").resolve()
    link = root / "swap"
    link.symlink_to("plain")
    done = threading.Event()

    def swap() -> None:
        targets, flips = ("plain", str(outside_dir)), 0
        while not done.is_set():
            staging = root / f".swap-{flips % 2}"
            staging.symlink_to(targets[flips % 2])
            os.replace(staging, link)  # atomic: the link always exists, pointing one way or the other
            flips += 1

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    digests, refused = [], 0
    try:
        for _ in range(200):
            try:
                digests.append(registry.load("swapped", "swap", replace=True).digest)
            except InvalidArgument as error:
                assert "outside the adapter root" in str(error)
                refused += 1
    finally:
        done.set()
        swapper.join(10)
        registry.close()
    assert set(digests) <= {inside}, "a load read the adapter outside the root"
    assert len(digests) + refused == 200


# Swaps two names atomically (renameat2 RENAME_EXCHANGE, Linux) every `period` seconds until killed:
# an attacker in a process of its own, not slowed by the loads' GIL.
_EXCHANGER = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
a, b, period = sys.argv[1].encode(), sys.argv[2].encode(), float(sys.argv[3])
print(libc.renameat2(-100, a, -100, b, 2) == 0, flush=True)
while libc.renameat2(-100, a, -100, b, 2) == 0:
    time.sleep(period)
"""


def test_no_load_reads_outside_the_root_while_a_directory_and_a_symlink_trade_places(
        root, adapter_in_root, tmp_path, make_adapter, base_model_dir):
    """root/flip is, in turn, a real adapter directory and a symlink to one outside (swapped
    atomically by another process) during 200 loads: a check-then-open-by-name would read the
    outside files whenever the swap lands between the two; opened by descriptor, none is read."""
    make_adapter(tmp_path / "outside", seed=1, lora_alpha=16)  # other weights and scale: another digest
    registry = AdapterRegistry(RegistryConfig(root=root, admin_token="", base_model_dir=base_model_dir))
    inside = registry.load("inside", "plain").digest
    flip, link = root / "flip", root / ".flip-link"
    shutil.copytree(adapter_in_root, flip)
    link.symlink_to((tmp_path / "outside").resolve(), target_is_directory=True)
    swapper = subprocess.Popen([sys.executable, "-c", _EXCHANGER, str(flip), str(link), "0.0002"],
                               stdout=subprocess.PIPE, text=True)
    digests, refused = [], 0
    try:
        if swapper.stdout.readline().strip() != "True":
            pytest.skip("renameat2(RENAME_EXCHANGE) is not supported here")
        for _ in range(200):
            try:
                digests.append(registry.load("flipped", "flip", replace=True).digest)
            except InvalidArgument as error:  # it was the symlink, or a file in the link's place
                assert "outside the adapter root" in str(error) or "not a directory" in str(error)
                refused += 1
    finally:
        swapper.kill()
        swapper.wait()
        registry.close()
    assert set(digests) <= {inside}, "a load read the adapter outside the root"
    assert len(digests) + refused == 200
