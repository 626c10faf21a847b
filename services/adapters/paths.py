"""Opening client-supplied adapter paths inside the adapter root, race-free (ARCHITECTURE invariant 6).

A path is never resolved and then opened by name (a symlink swapped in between would be followed
out of the root). The walk holds a descriptor of the root and opens each component relative to
its parent's descriptor (`openat`: `os.open(name, dir_fd=parent)`) with O_NOFOLLOW, so the kernel
follows no symlink and no `..`: a symlink is read (`readlink`) and its target walked the same way
from the directory holding it (an absolute target only when it lies under the root, from the
root), and `..` steps back to a descriptor the walk already holds, never above the root. Files are
then opened relative to the adapter directory's descriptor and read only through their own
descriptors (`AdapterDir.read_file`), so what is read is what the walk found inside the root,
whatever is renamed or re-linked on disk meanwhile.

The client path itself is normalized lexically first (`posixpath.normpath`): `a/../b` is `b`
whatever `a` is, and a path that climbs above the root is refused before anything is opened.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import stat
from pathlib import Path

from services.common.errors import InvalidArgument, NotFound

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
MAX_SYMLINKS = 40  # symlinks followed in one walk, as Linux's MAXSYMLINKS
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; fstat then refuses it.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class _Outside(Exception):
    """The walk would leave the root (a `..` above it, or an absolute symlink target outside it)."""


class _Missing(Exception):
    """A component does not exist."""


class _NotDirectory(Exception):
    """A component that must be a directory is something else."""


class AdapterDir:
    """A directory inside the adapter root, held open: the descriptors from the root down to it.

    `path` is its catalog form, POSIX and relative to the root ("." for the root itself);
    `display` the absolute path for messages. Close it (or use it as a context manager).
    """

    def __init__(self, root: Path, fds: list[int], names: list[str]) -> None:
        self.root, self._fds, self._names = root, fds, names

    @property
    def path(self) -> str:
        return "/".join(self._names) or "."

    @property
    def display(self) -> Path:
        return self.root.joinpath(*self._names)

    def read_file(self, filename: str) -> bytes:
        """The bytes of regular file `filename` in this directory, read through its own descriptor.

        A symlinked file is followed only inside the root (the module docstring).

        Raises:
            InvalidArgument: the file is missing or not a regular file ("... is not a PEFT LoRA
                directory: NAME is missing"), resolves outside the root, or cannot be read.
        """
        fds, names, borrowed = list(self._fds), list(self._names), frozenset(self._fds)
        try:
            fd = _walk(self.root, fds, names, [filename], borrowed, final_is_dir=False)
        except _Outside:
            raise InvalidArgument(f"{filename} in {self.display} resolves outside the adapter root "
                                  f"{self.root}") from None
        except (_Missing, _NotDirectory):
            fd = None
        except OSError as error:
            raise InvalidArgument(f"{filename} in {self.display} is not readable: "
                                  f"{error.strerror or error}") from None
        finally:
            _release(fds, borrowed)
        if fd is None:
            raise InvalidArgument(f"{self.display} is not a PEFT LoRA directory: {filename} is missing")
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise InvalidArgument(f"{self.display} is not a PEFT LoRA directory: {filename} is missing "
                                      "(not a regular file)")
            try:
                return file.read()
            except OSError as error:
                raise InvalidArgument(f"{filename} in {self.display} is not readable: "
                                      f"{error.strerror or error}") from None

    def close(self) -> None:
        _release(self._fds)

    def __enter__(self) -> AdapterDir:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def open_in_root(root: Path, client_path: str) -> AdapterDir:
    """The directory `client_path` names, opened inside `root` (the module docstring).

    Relative paths start at the root; absolute paths are allowed only when they lie under it (as
    given or as resolved).

    Returns:
        The open directory (a context manager).

    Raises:
        InvalidArgument: empty path, a NUL byte, a remote URL, a path or symlink leading outside
            the root, a component that cannot be opened (too long, a symlink loop), or not a directory.
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
    parts = _parts_under(real_root, client_path, also=root.absolute())
    if parts is None:
        raise InvalidArgument(f"adapter path {client_path!r} resolves outside the adapter root {real_root}")
    fds: list[int] = []
    names: list[str] = []
    try:
        fds.append(os.open(real_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))  # the root's own path is trusted
        fds.append(_walk(real_root, fds, names, parts, frozenset(), final_is_dir=True))
    except BaseException as error:
        _release(fds)
        _refuse(error, client_path, real_root)
        raise
    return AdapterDir(real_root, fds, names)


def _refuse(error: BaseException, client_path: str, real_root: Path) -> None:
    """Raise the refusal for a failed walk (returns only for an error that is no refusal)."""
    if isinstance(error, _Outside):
        raise InvalidArgument(f"adapter path {client_path!r} resolves outside the adapter root {real_root}") from None
    if isinstance(error, _Missing):
        raise NotFound(f"adapter path {client_path!r} does not exist under the adapter root {real_root}") from None
    if isinstance(error, _NotDirectory):
        raise InvalidArgument(f"adapter path {client_path!r} is not a directory; expected a PEFT LoRA "
                              "directory") from None
    if isinstance(error, OSError):  # e.g. a component longer than the file system allows, a symlink loop
        raise InvalidArgument(f"adapter path {client_path!r} is not usable: {error.strerror or error}") from None


def _parts_under(real_root: Path, path: str, also: Path) -> list[str] | None:
    """The components of `path` below the root after lexical normalization, or None when it
    climbs above the root or is absolute and under neither `real_root` nor `also`."""
    normal = posixpath.normpath(path)
    if posixpath.isabs(normal):
        for base in (str(real_root), str(also)):
            if normal == base or normal.startswith(base.rstrip("/") + "/"):
                normal = posixpath.relpath(normal, base)
                break
        else:
            return None
    if normal == ".." or normal.startswith("../"):
        return None
    return [part for part in normal.split("/") if part not in ("", ".")]


def _walk(real_root: Path, fds: list[int], names: list[str], parts: list[str], borrowed: frozenset[int],
          final_is_dir: bool) -> int:
    """Open `parts` below `fds[-1]` (whose path from the root is `names`; `fds[0]` is the root)
    component by component and return the last one's new descriptor (a duplicate of the directory
    reached when the parts end in a directory step: none, `..`, a trailing `/`).

    `fds` and `names` are the stack of directories walked through, updated in place as the walk
    goes down and back up: the walk closes a descriptor it pops unless it is in `borrowed` (the
    caller's); the caller closes the others left on the stack.

    Raises:
        _Outside, _Missing, _NotDirectory, or OSError (a symlink loop: ELOOP; too long a name).
    """
    pending = list(reversed(parts))  # a stack: the next component is last
    links = 0
    while pending:
        name = pending.pop()
        if name in ("", "."):
            continue
        if name == "..":
            if len(fds) <= 1:
                raise _Outside
            _pop(fds, names, borrowed)
            continue
        last = not pending
        try:
            fd = os.open(name, _DIR_FLAGS if (final_is_dir or not last) else _FILE_FLAGS, dir_fd=fds[-1])
        except OSError as error:
            if error.errno == errno.ENOENT:
                raise _Missing from None
            if error.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            target = _link_target(name, fds[-1])
            if target is None:
                if error.errno == errno.ELOOP:
                    raise
                raise (_NotDirectory if last else _Missing) from None
            links += 1
            if links > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP)) from None
            pending.extend(reversed(_link_parts(real_root, target, fds, names, borrowed)))
            continue
        if last:
            names.append(name)
            return fd
        fds.append(fd)
        names.append(name)
    return os.dup(fds[-1])


def _link_target(name: str, dir_fd: int) -> str | None:
    """The target of symlink `name` in `dir_fd`, or None when `name` is no symlink."""
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.EINVAL:  # not a symlink
            return None
        if error.errno == errno.ENOENT:
            raise _Missing from None
        raise


def _link_parts(real_root: Path, target: str, fds: list[int], names: list[str],
                borrowed: frozenset[int]) -> list[str]:
    """The components to walk for a symlink's `target`: a relative one from where the link is; an
    absolute one from the root (the walk first climbs back to it), if it lies under the root."""
    if not posixpath.isabs(target):
        return target.split("/")
    parts = _parts_under(real_root, target, also=real_root)
    if parts is None:
        raise _Outside
    while len(fds) > 1:
        _pop(fds, names, borrowed)
    return parts


def _pop(fds: list[int], names: list[str], borrowed: frozenset[int]) -> None:
    """Step up one directory, closing the one left unless it is borrowed."""
    fd = fds.pop()
    names.pop()
    if fd not in borrowed:
        os.close(fd)


def _release(fds: list[int], borrowed: frozenset[int] = frozenset()) -> None:
    """Close every descriptor of `fds` that is not borrowed, and empty the list."""
    while fds:
        fd = fds.pop()
        if fd not in borrowed:
            os.close(fd)
