"""Helpers shared by the `tessera up` tests."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

from tessera.cli.up.spec import METRICS_PORT_OFFSET


def free_base_port(num_ports: int, low: int = 21000, span: int = 25000) -> int:
    """A base port in [low, low + span) whose `num_ports` gRPC ports and their metrics ports are free now."""
    for attempt in range(200):
        base = low + (os.getpid() * 131 + attempt * 977) % (span - METRICS_PORT_OFFSET - num_ports)
        try:
            for port in range(base, base + num_ports):
                for p in (port, port + METRICS_PORT_OFFSET):
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no free port range in {low}-{low + span - 1}")


def process_argvs() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process this user can read in /proc (those gone meanwhile are skipped)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            yield int(entry.name), (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
