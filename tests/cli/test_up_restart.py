"""`tessera up`'s restart decision: a service that exited, or whose health has not said SERVING for
the bound, is due for a kill and restart; a healthy one never is."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.launch import free_port
from tessera.cli.up.supervise import RestartPolicy, kill, services_to_restart


def test_policy_restarts_on_exit_at_once_and_on_unhealth_after_the_bound():
    policy = RestartPolicy(unhealthy_s=30)
    assert policy.reason("pooling", 0, False, now=0) == "exited unexpectedly (code 0)"
    assert policy.reason("decoder", None, True, now=0) is None
    assert policy.reason("decoder", None, False, now=10) is None       # NOT_SERVING: the clock starts
    assert policy.reason("decoder", None, False, now=39.9) is None
    assert policy.reason("decoder", None, True, now=40) is None        # SERVING again: the clock resets
    assert policy.reason("decoder", None, False, now=50) is None
    assert policy.reason("decoder", None, False, now=79) is None
    assert policy.reason("decoder", None, False, now=80) == \
        "has not been SERVING for 30 s (its health says why in its log)"
    assert policy.reason("decoder", None, False, now=81) is None       # restarted: a fresh clock


def test_services_to_restart_probes_real_health_and_processes():
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    addresses = {"decoder": f"127.0.0.1:{port}", "pooling": f"127.0.0.1:{port}",
                 "vision": f"127.0.0.1:{free_port()}"}  # nothing listens there: no health answer
    processes = {"decoder": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
                 "pooling": subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]),
                 "vision": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])}
    try:
        processes["pooling"].wait(10)
        policy = RestartPolicy(unhealthy_s=1.0)
        assert services_to_restart(processes, addresses.get, policy) == [
            ("pooling", "exited unexpectedly (code 3)")]
        del processes["pooling"]
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # the decoder's engine loop died
        assert services_to_restart(processes, addresses.get, policy) == []
        time.sleep(1.1)
        due = dict(services_to_restart(processes, addresses.get, policy))
        assert set(due) == {"decoder", "vision"} and "has not been SERVING for 1 s" in due["decoder"]
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        time.sleep(1.1)
        assert [s for s, _ in services_to_restart(processes, addresses.get, policy)] == []  # vision: clock restarted
        kill(processes["decoder"])
        assert processes["decoder"].returncode == -9
    finally:
        for process in processes.values():
            kill(process)
        server.stop(0)
