"""Client paths stay inside the adapter root: `..`, absolute, symlink and URL escapes are refused."""

from __future__ import annotations

import shutil

import pytest

from services.adapters.paths import resolve_in_root
from services.adapters.peft_format import read_peft_adapter
from services.common.errors import InvalidArgument, NotFound
from services.common.names import check_adapter_name


def test_relative_and_absolute_inside_resolve_to_the_same_dir(root, adapter_in_root):
    assert resolve_in_root(root, "plain") == adapter_in_root.resolve()
    assert resolve_in_root(root, str(adapter_in_root)) == adapter_in_root.resolve()
    assert resolve_in_root(root, "sub/../plain") == adapter_in_root.resolve()


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
    directory = resolve_in_root(root, "plain")  # the directory itself is inside
    with pytest.raises(InvalidArgument, match="adapter_model.safetensors .*resolves outside the adapter root"):
        read_peft_adapter(directory, root, "x", 64)


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
