"""Helpers shared by the `tessera up` tests."""

from __future__ import annotations

import os
import socket

from tessera.cli.up import METRICS_PORT_OFFSET


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
