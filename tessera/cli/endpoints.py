"""`<log dir>/endpoints.json`, which `tessera up` writes: where each process of a cluster serves
gRPC and Prometheus /metrics, and the gateway's HTTP API /metrics (every decoder replica's vLLM
series relayed with the gateway's own). `tessera info` reads it (stdlib and tessera.paths only: a
client command imports no service code)."""

from __future__ import annotations

import json
from pathlib import Path

from tessera.paths import cluster_home, tessera_home

ENDPOINTS_FILE = "endpoints.json"


def metrics_table(gateway_address: str, log_dir: Path | None = None) -> str:
    """The metrics URLs `tessera up` wrote for the cluster whose gateway is `gateway_address`
    (one line per process, then the HTTP API's when it serves one), or "" when no local `up` serves
    that gateway. Without `log_dir`, the clusters under $TESSERA_HOME/clusters are looked through,
    the one named for the gateway's port first (a cluster started with `--cluster NAME` lives
    under its name)."""
    if log_dir is not None:
        paths = [log_dir / ENDPOINTS_FILE]
    else:
        paths = [cluster_home(gateway_address.rpartition(":")[2]) / "logs" / ENDPOINTS_FILE,
                 *sorted((tessera_home() / "clusters").glob(f"*/logs/{ENDPOINTS_FILE}"))]
    for path in paths:
        try:
            endpoints = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if endpoints.get("gateway") == gateway_address:
            lines = [f"{'metrics':<8} {name:<10} {entry['metrics']}\n" for name, entry in endpoints["services"].items()]
            if endpoints.get("http_metrics"):
                lines.append(f"{'metrics':<8} {'http api':<10} {endpoints['http_metrics']}  (with every decoder's vllm:*)\n")
            return "".join(lines)
    return ""
