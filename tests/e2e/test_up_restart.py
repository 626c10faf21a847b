"""`tessera up`'s supervision on the real cluster: a service that stops answering health (frozen
with SIGSTOP: alive, not SERVING) is killed and started again, and serves through the gateway again."""

from __future__ import annotations

import signal
import time

from services.common.healthcheck import check as check_health
from tessera.cli.up.supervise import RestartPolicy, Supervisor

from .conftest import embed_once_back


def test_up_restarts_a_service_that_is_not_serving(cluster, gateway, assert_healthy):
    frozen = cluster.processes["pooling"]
    others = {name: process for name, process in cluster.processes.items() if name != "pooling"}
    frozen.send_signal(signal.SIGSTOP)
    supervisor = Supervisor(cluster, RestartPolicy(unhealthy_s=2.0))
    started = time.monotonic()
    try:
        while cluster.processes["pooling"] is frozen or check_health(cluster.spec.address("pooling")) is not None:
            supervisor.step()
            assert time.monotonic() - started < 120, "pooling was not restarted"
            time.sleep(0.5)
    finally:
        if frozen.poll() is None:
            frozen.send_signal(signal.SIGCONT)
    assert frozen.returncode == -signal.SIGKILL
    assert all(cluster.processes[name] is process for name, process in others.items())  # only the frozen one
    assert time.monotonic() - started >= 2.0
    assert list(embed_once_back(gateway).embeddings.shape) == [1, 384]
    assert_healthy()
