"""$TESSERA_EXIT_UNHEALTHY_AFTER_S: a service whose own health check has said NOT_SERVING for that
long in a row closes its port and exits with status 3, so that compose's `restart` policy (which acts
only on exits) restarts it; shorter spells of NOT_SERVING do not end it, and unset it never exits."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.launch import free_port
from services.common.server import (
    EXIT_UNHEALTHY,
    EXIT_UNHEALTHY_ENV,
    Hooks,
    exit_unhealthy_after_s,
    insecure_channel,
    serve,
)
from tests.common.serving import serving

SERVING = health_pb2.HealthCheckResponse.SERVING


def _serve_until_exit(address: str, verdicts, stopped: list) -> tuple[list[int], float]:
    """Serve with `verdicts()` as the health check until `serve` returns; (exit codes it asked for, when)."""
    exits: list[int] = []

    async def stop() -> None:
        stopped.append(True)

    async def main() -> float:
        task = asyncio.create_task(serve("svc", address, lambda server: [], Hooks(stop=stop, health=verdicts),
                                         exit_process=exits.append))
        async with insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10,
                                                                    wait_for_ready=True)
            assert reply.status == SERVING
            await asyncio.wait_for(task, 30)
            ended = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError):  # the port is closed before the exit
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return ended

    return exits, asyncio.run(main())


def test_a_service_not_serving_for_the_bound_closes_its_port_and_exits_3(monkeypatch):
    monkeypatch.setenv(EXIT_UNHEALTHY_ENV, "1.5")
    began = time.monotonic()
    spells = {"healthy_until": began + 1.0}

    def verdicts():
        now = time.monotonic()
        if now < spells["healthy_until"]:
            return None
        if now < spells["healthy_until"] + 1.0:  # a first spell, shorter than the bound: no exit
            return "the decoder engine is wedged: no step completed for 60 s"
        if now < spells["healthy_until"] + 2.0:
            return None
        return "the decoder engine stopped: RuntimeError: injected"

    stopped: list = []
    exits, ended = _serve_until_exit(f"127.0.0.1:{free_port()}", verdicts, stopped)
    assert exits == [EXIT_UNHEALTHY] == [3]
    unhealthy_from = spells["healthy_until"] + 2.0
    assert 1.5 <= ended - unhealthy_from < 1.5 + 1.5 + 5.0  # the bound, two polls, the drain's grace
    assert stopped == [], "a wedged service's stop may never return: the process exits without it"


def test_without_the_variable_an_unhealthy_service_keeps_running(monkeypatch):
    monkeypatch.delenv(EXIT_UNHEALTHY_ENV, raising=False)

    async def main():
        async with serving("svc", lambda server: [], health=lambda: "the loop died") as channel:
            await asyncio.sleep(3)
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status  # and `serving` stops it with SIGTERM, as it would any running service

    assert asyncio.run(main()) == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(EXIT_UNHEALTHY_ENV, value)
    with pytest.raises(ValueError, match=rf"\$TESSERA_EXIT_UNHEALTHY_AFTER_S must be a positive number of seconds, "
                                         rf"got '{value}'"):
        exit_unhealthy_after_s()
    monkeypatch.setenv(EXIT_UNHEALTHY_ENV, " 30 ")
    assert exit_unhealthy_after_s() == 30.0
    monkeypatch.setenv(EXIT_UNHEALTHY_ENV, "")
    assert exit_unhealthy_after_s() is None


def test_the_process_exits_3_with_its_log_line(tmp_path):
    """The real exit (os._exit, past threads that would never join), and the log line before it."""
    script = textwrap.dedent(f"""
        import asyncio, logging, threading
        from services.common.server import Hooks, serve
        logging.basicConfig(level=logging.INFO)
        threading.Thread(target=threading.Event().wait, name="wedged-worker").start()  # never joins
        asyncio.run(serve("svc", "127.0.0.1:{free_port()}", lambda server: [], Hooks(health=lambda: "the loop died")))
    """)
    env = {**os.environ, EXIT_UNHEALTHY_ENV: "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_UNHEALTHY, done.stderr
    assert "svc: NOT_SERVING for 1 s (the loop died): exiting with status 3 to be restarted" in done.stderr


def test_a_service_refuses_a_bad_value_in_one_line(tmp_path):
    env = {**os.environ, EXIT_UNHEALTHY_ENV: "soon"}
    done = subprocess.run([sys.executable, "-m", "services.adapters", "--address", f"127.0.0.1:{free_port()}",
                           "--root", str(tmp_path), "--db", str(tmp_path / "catalog.sqlite3")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2  # a bad value, as a bad flag (services/common/run.py)
    assert done.stderr.strip().splitlines()[-1] == ("python -m services.adapters: error: "
                                                    "$TESSERA_EXIT_UNHEALTHY_AFTER_S must be a positive number of "
                                                    "seconds, got 'soon'")
