"""Resolving client-supplied adapter paths inside the adapter root (ARCHITECTURE invariant 6)."""

from __future__ import annotations

import re
from pathlib import Path

from services.common.errors import InvalidArgument, NotFound

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def resolve_in_root(root: Path, client_path: str) -> Path:
    """The real directory `client_path` names, guaranteed inside `root`.

    Relative paths are joined to the root; absolute paths are allowed only if inside it. The
    check runs after `resolve()`, so `..` segments and symlinks pointing out are both caught.

    Returns:
        The resolved absolute directory.

    Raises:
        InvalidArgument: empty path, a remote URL, a path resolving outside the root, or not a directory.
        NotFound: the path is inside the root but does not exist.
    """
    if not client_path:
        raise InvalidArgument("adapter path is empty; give a directory relative to the adapter root")
    if "\x00" in client_path:
        raise InvalidArgument("adapter path contains a NUL byte")
    if _URL.match(client_path):
        raise InvalidArgument(f"adapter path {client_path!r} is a remote URL; only directories inside "
                              "the adapter root can be loaded")
    real_root = root.resolve()
    candidate = Path(client_path)
    joined = candidate if candidate.is_absolute() else real_root / candidate
    try:
        resolved = joined.resolve()
        inside = resolved.is_relative_to(real_root)
        exists, is_dir = inside and resolved.exists(), inside and resolved.is_dir()
    except OSError as error:  # e.g. a component longer than the file system allows, a symlink loop
        raise InvalidArgument(f"adapter path {client_path!r} is not usable: {error.strerror or error}") from None
    if not inside:
        raise InvalidArgument(f"adapter path {client_path!r} resolves outside the adapter root {real_root}")
    if not exists:
        raise NotFound(f"adapter path {client_path!r} does not exist under the adapter root {real_root}")
    if not is_dir:
        raise InvalidArgument(f"adapter path {client_path!r} is not a directory; expected a PEFT LoRA directory")
    return resolved


def file_in_root(root: Path, directory: Path, filename: str) -> Path:
    """`directory/filename`, refused if it is a symlink leading outside the root.

    Raises:
        InvalidArgument: the file is missing, not a regular file, or resolves outside the root.
    """
    path = (directory / filename).resolve()
    if not path.is_relative_to(root.resolve()):
        raise InvalidArgument(f"{filename} in {directory} resolves outside the adapter root {root.resolve()}")
    if not path.is_file():
        raise InvalidArgument(f"{directory} is not a PEFT LoRA directory: {filename} is missing")
    return path


def relative_to_root(root: Path, resolved: Path) -> str:
    """The catalog form of a resolved path: POSIX, relative to the root ("." for the root itself)."""
    return resolved.relative_to(root.resolve()).as_posix()
