"""`<log dir>/endpoints.json`, which `tessera up` writes: where each process of a cluster serves
gRPC and Prometheus /metrics. `tessera info` reads it (stdlib and tessera.paths only: a
client command imports no service code)."""

from __future__ import annotations

import json
from pathlib import Path

from tessera.paths import cluster_home

ENDPOINTS_FILE = "endpoints.json"


def metrics_table(gateway_address: str, log_dir: Path | None = None) -> str:
    """The metrics URLs `tessera up` wrote for the cluster whose gateway is `gateway_address`
    (one line per process), or "" when the last local `up` served another gateway or none."""
    path = (log_dir or cluster_home(gateway_address.rpartition(":")[2]) / "logs") / ENDPOINTS_FILE
    try:
        endpoints = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    if endpoints.get("gateway") != gateway_address:
        return ""
    return "".join(f"{'metrics':<8} {name:<10} {entry['metrics']}\n" for name, entry in endpoints["services"].items())
