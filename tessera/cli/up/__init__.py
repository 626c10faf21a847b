"""`tessera up`: start the five services on loopback, wait for health, keep them running, stop them
together on Ctrl-C / SIGTERM.

Four modules, one job each: `spec` (the cluster: processes, ports, command lines, checked before
any process starts), `claim` (the cluster's name and ports, taken before anything is written: a
second `up` of a running cluster's name or ports exits 1), `launch` (process control: start, wait
for health, stop) and `supervise` (restart policy and backoff once the cluster is up).
`run_until_signalled` is the command's loop over them.
"""

from __future__ import annotations

import signal
import sys
import time

from tessera.cli.logfiles import StartupError
from tessera.cli.up.claim import ClusterBusy
from tessera.cli.up.launch import Cluster, StartInterrupted
from tessera.cli.up.spec import ClusterSpec
from tessera.cli.up.supervise import Supervisor
from tessera.protocol import MODEL_IMPL_TEXT


def model_path_line(spec: ClusterSpec) -> str:
    """Which path the decoder's checkpoint takes, in one line, e.g. "GPTNeoXForCausalLM (model_type
    'gpt_neox') on transformers (transformers' own modeling code on tessera's paged KV cache)"."""
    checkpoint = spec.checkpoint
    architecture = ", ".join(checkpoint.architectures) or "no architecture named"
    return f"{architecture} (model_type {checkpoint.model_type!r}) on {MODEL_IMPL_TEXT[spec.model_impl]}"


def run_until_signalled(spec: ClusterSpec) -> int:
    """Start, print endpoints, keep every process running (`Supervisor`) and stop all on Ctrl-C /
    SIGTERM. Returns 0 (stopped by a signal), 1 (the cluster runs already, a port it needs is in
    use, or a service failed to start) or 130 (interrupted while starting)."""
    cluster = Cluster(spec)
    stop = {"signalled": False}

    def on_signal(signum, frame):
        stop["signalled"] = True

    try:
        cluster.claim()
    except ClusterBusy as busy:
        print(f"error: {busy}", file=sys.stderr, flush=True)
        return 1
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print("starting " + ", ".join(spec.services()) + f" (logs in {spec.log_dir})", flush=True)
    print(f"decoder model: {model_path_line(spec)}", flush=True)
    try:
        cluster.start(interrupted=lambda: stop["signalled"])
    except StartInterrupted:
        print("interrupted while starting: stopped the services", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT  # the shell's status for a command ended by SIGINT (main's INTERRUPTED)
    except StartupError as error:
        print(error.report(), file=sys.stderr, flush=True)
        print("stopped the other services", file=sys.stderr, flush=True)
        return 1
    for service in spec.services():
        print(f"  {service:<9} {spec.address(service)}  SERVING  metrics {spec.metrics_url(service)}", flush=True)
    http = f", HTTP at http://{spec.host}:{spec.http_port}" if spec.http_port else ""
    print(f"tessera is up: gateway at {spec.address('gateway')}{http} (Ctrl-C to stop)", flush=True)
    supervisor = Supervisor(cluster)
    while not stop["signalled"]:
        supervisor.step(interrupted=lambda: stop["signalled"])
        time.sleep(0.5)
    print("stopping tessera", flush=True)
    cluster.stop()
    return 0
