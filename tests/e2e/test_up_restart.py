"""`tessera up`'s restart step on the real cluster: a service that stops answering health (frozen
with SIGSTOP: alive, not SERVING) is killed and restarted, and serves through the gateway again."""

from __future__ import annotations

import signal
import time

from tessera.cli.up import RestartPolicy, restart_failing

from .conftest import embed_once_back


def test_up_restarts_a_service_that_is_not_serving(cluster, gateway, assert_healthy):
    frozen = cluster.processes["pooling"]
    frozen.send_signal(signal.SIGSTOP)
    policy, restarts = RestartPolicy(unhealthy_s=2.0), []
    started = time.monotonic()
    try:
        while cluster.processes["pooling"] is frozen:
            assert restart_failing(cluster, policy, restarts)
            assert time.monotonic() - started < 120, "pooling was not restarted"
            time.sleep(0.5)
    finally:
        if frozen.poll() is None:
            frozen.send_signal(signal.SIGCONT)
    assert frozen.returncode == -signal.SIGKILL and len(restarts) == 1  # only the frozen one
    assert time.monotonic() - started >= 2.0
    assert list(embed_once_back(gateway).embeddings.shape) == [1, 384]
    assert_healthy()
