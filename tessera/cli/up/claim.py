"""What `tessera up` checks and takes before it writes or starts anything (`claim`).

A cluster's name is its directory (logs, internal token, endpoints.json): two clusters of one name
would share them, and the second would overwrite the first's internal-token file, which the
first's next restarted service then reads. So `up` holds an exclusive lock (flock(2)) on
`<log dir>/up.pid`, which holds its pid, for as long as it runs; the kernel drops the lock when
the process ends however it ends, so a crashed `up` leaves no stale claim. A cluster whose `up`
was killed but whose services still run is found through its endpoints.json: its gateway's port
still taken. Every port the cluster will listen on (`ClusterSpec.ports`: gRPC, metrics, HTTP) is
bind-tested on its host, as the service would bind it (SO_REUSEADDR, as grpc, uvicorn and
prometheus-client set it): a port another process listens on is refused naming the process,
the port and the flag that sets it, where the service itself would fail to bind only after
`up` had started the others.

Either refusal is a `ClusterBusy` raised before anything is written; `tessera up` prints it as
one line and exits 1.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from tessera.cli.endpoints import ENDPOINTS_FILE
from tessera.cli.up.spec import ClusterSpec, PortUse

UP_PID_FILE = "up.pid"  # in the cluster's log dir: the running `up`'s pid, flock'ed while it runs


class ClusterBusy(Exception):
    """The cluster cannot start here now: its name is taken by a running cluster, or a port it needs
    is in use. `str()` is one line naming the cluster, or the process, port and flag."""


class Claim:
    """A cluster's name, held: the locked `up.pid` file descriptor. `release()` empties and unlocks it
    (the file stays: removing a lock file races with the next `up` opening it)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing the descriptor drops its flock
        self._fd = None


def claim(spec: ClusterSpec) -> Claim:
    """Check that `spec`'s cluster is not running and that every port it needs is free, then take
    the cluster's name (creating its log dir). Nothing is written before both checks pass.

    Raises:
        ClusterBusy: the cluster's `up` runs (its up.pid is locked), its services still run (the
            gateway of its endpoints.json listens), or a port is in use.
    """
    path = spec.log_dir / UP_PID_FILE
    pid = running_pid(path)
    if pid is not None:
        raise _running(spec, path, pid)
    orphan = _listening_gateway(spec.log_dir / ENDPOINTS_FILE)
    if orphan:
        raise ClusterBusy(f"cluster {spec.cluster!r} is running: no `tessera up` holds it, but the gateway its "
                          f"{spec.log_dir / ENDPOINTS_FILE} lists still listens at {orphan}; stop those services "
                          "first, or give this cluster another --cluster")
    check_ports_free(spec.ports())
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another `up` of this name took it since the check
        os.close(fd)
        raise _running(spec, path, running_pid(path) or 0) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return Claim(path, fd)


def running_pid(path: Path) -> int | None:
    """The pid in `path` when a process holds its lock (0 when the file holds none), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 64).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_ports_free(ports: list[PortUse]) -> None:
    """Raises ClusterBusy for the first of `ports` a server could not listen on now."""
    for use in ports:
        error = bind_error(use.host, use.port)
        if error is not None:
            cause = "in use" if error.errno == errno.EADDRINUSE else "cannot be bound"
            raise ClusterBusy(f"{use} is {cause} ({error.strerror or error}): stop the process that holds it, or "
                              f"choose another {use.flag}")


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on host:port now (errno EADDRINUSE: another socket holds it), or None."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers: TIME_WAIT is no use
            probe.bind(address)
    except OSError as error:  # socket.gaierror included: a host this machine cannot bind
        return error
    return None


def _running(spec: ClusterSpec, path: Path, pid: int) -> ClusterBusy:
    held = f"pid {pid}" if pid else "a running process"
    return ClusterBusy(f"cluster {spec.cluster!r} is running (tessera up, {held}, holds {path}); stop it first, "
                       "or give this cluster another --cluster")


def _listening_gateway(endpoints: Path) -> str | None:
    """The gateway address `endpoints` lists when something listens there, else None."""
    try:
        address = json.loads(endpoints.read_text())["gateway"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    host, _, port = str(address).rpartition(":")
    if not port.isdigit():
        return None
    error = bind_error(host.strip("[]"), int(port))
    return address if error is not None and error.errno == errno.EADDRINUSE else None
