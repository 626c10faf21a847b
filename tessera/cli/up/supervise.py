"""Supervision of a started cluster: `tessera up` never stops it on its own (`Supervisor`).

A process that exits, or whose health has not said SERVING for UNHEALTHY_RESTART_S (its engine
loop died or is wedged), is killed and started again (`RestartPolicy`), as an orchestrator's
liveness probe would, while the others keep serving. A start that fails (it exits, or is not
SERVING within START_TIMEOUT_S) is retried with a backoff of its own, as Kubernetes'
CrashLoopBackOff (`CrashLoopBackoff`): BACKOFF_FIRST_S, doubling up to BACKOFF_MAX_S, and
BACKOFF_FIRST_S again once the process has served BACKOFF_RESET_S in a row. Each failure is one
line on stderr: the process, the cause, the next try.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

from services.common.healthcheck import check as check_health
from tessera.cli.up.launch import START_TIMEOUT_S, Cluster

UNHEALTHY_RESTART_S = 30.0  # NOT_SERVING (or no health answer) this long -> killed and restarted
BACKOFF_FIRST_S = 1.0  # a failed process is started again this long after its first failure,
BACKOFF_MAX_S = 60.0  # twice as long after each next one, at most this long,
BACKOFF_RESET_S = 120.0  # and after BACKOFF_FIRST_S again once it has been SERVING this long in a row


class CrashLoopBackoff:
    """How long a process that failed waits before it is started again, as Kubernetes'
    CrashLoopBackOff: `first_s` after its first failure, twice as long after each next one, at most
    `max_s`; a failure after the process had been SERVING `reset_s` in a row counts as a first one.
    Kept per process: one replica's crash loop never delays another's restart."""

    def __init__(self, first_s: float = BACKOFF_FIRST_S, max_s: float = BACKOFF_MAX_S,
                 reset_s: float = BACKOFF_RESET_S) -> None:
        self.first_s, self.max_s, self.reset_s = first_s, max_s, reset_s
        self._delay_s: dict[str, float] = {}

    def delay_s(self, service: str, served_s: float) -> float:
        """Seconds until `service` is started again after a failure; `served_s`: how long it had been
        SERVING before it failed (0: it failed while starting)."""
        last = self._delay_s.get(service)
        delay = self.first_s if last is None or served_s >= self.reset_s else min(2 * last, self.max_s)
        self._delay_s[service] = delay
        return delay


class Supervisor:
    """Keeps the processes of a started cluster running, one `step()` at a time, never stopping it.

    A process is SERVING (`policy` says when it must be killed: it exited or stays unhealthy),
    waiting out its `backoff` after a failure, or started again (it fails when it exits or is not
    SERVING within `start_timeout_s`). A failure prints one line on stderr (the process, the cause,
    the next try) and leaves the other processes alone: the gateway routes to a service's other
    replicas, or answers UNAVAILABLE naming it, meanwhile.
    """

    def __init__(self, cluster: Cluster, policy: RestartPolicy | None = None,
                 backoff: CrashLoopBackoff | None = None, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.cluster = cluster
        self.policy = policy or RestartPolicy()
        self.backoff = backoff or CrashLoopBackoff()
        self.start_timeout_s = start_timeout_s
        now = time.monotonic()
        self._serving_since = dict.fromkeys(cluster.processes, now)  # SERVING: since when
        self._retry_at: dict[str, float] = {}  # failed: when it is started again
        self._start_deadline: dict[str, float] = {}  # started again, not yet SERVING

    def step(self, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Fail the SERVING processes `policy` finds exited or unhealthy, start those whose backoff
        is over, and check on those started. Nothing more once `interrupted()` (Ctrl-C reaches the
        services too, and one dying of it is no failure of its own)."""
        serving = {name: self.cluster.processes[name] for name in self._serving_since}
        for name, reason in services_to_restart(serving, self.cluster.spec.address, self.policy):
            if interrupted():
                return
            kill(self.cluster.processes[name])
            self._failed(name, f"{name} {reason}")
        for name, at in list(self._retry_at.items()):
            if time.monotonic() >= at and not interrupted():
                self._start(name)
        for name in list(self._start_deadline):
            if not interrupted():
                self._check_started(name)

    def _start(self, name: str) -> None:
        del self._retry_at[name]
        try:
            self.cluster.spawn(name)
        except OSError as error:
            self._failed(name, f"{name} failed to start: {error}")
            return
        self._start_deadline[name] = time.monotonic() + self.start_timeout_s

    def _check_started(self, name: str) -> None:
        process = self.cluster.processes[name]
        if process.poll() is not None:
            error = self.cluster.startup_error(name, f"exited with code {process.returncode}")
        elif check_health(self.cluster.spec.address(name), timeout_s=1.0) is None:
            del self._start_deadline[name]
            self._serving_since[name] = time.monotonic()
            print(f"  {name:<9} {self.cluster.spec.address(name)}  SERVING again", flush=True)
            return
        elif time.monotonic() > self._start_deadline[name]:
            kill(process)
            error = self.cluster.startup_error(name, f"not SERVING after {self.start_timeout_s:.0f} s")
        else:
            return
        del self._start_deadline[name]
        self._failed(name, error.report().partition("\n")[0])

    def _failed(self, name: str, what: str) -> None:
        now = time.monotonic()
        delay = self.backoff.delay_s(name, served_s=now - self._serving_since.pop(name, now))
        self._retry_at[name] = now + delay
        at = time.strftime("%H:%M:%S", time.localtime(time.time() + delay))
        print(f"{what}; next try in {delay:g} s, at {at}", file=sys.stderr, flush=True)


class RestartPolicy:
    """When `up` restarts a service: it exited, or its health has not said SERVING (NOT_SERVING,
    or no answer) for `unhealthy_s` seconds in a row, as a liveness probe's failure threshold."""

    def __init__(self, unhealthy_s: float = UNHEALTHY_RESTART_S) -> None:
        self.unhealthy_s = unhealthy_s
        self._unhealthy_since: dict[str, float] = {}

    def reason(self, service: str, returncode: int | None, serving: bool, now: float) -> str | None:
        """Why `service` must be restarted now, or None. `now`: time.monotonic() seconds."""
        if returncode is not None:
            self._unhealthy_since.pop(service, None)
            return f"exited unexpectedly (code {returncode})"
        if serving:
            self._unhealthy_since.pop(service, None)
            return None
        since = self._unhealthy_since.setdefault(service, now)
        if now - since < self.unhealthy_s:
            return None
        del self._unhealthy_since[service]
        return f"has not been SERVING for {now - since:.0f} s (its health says why in its log)"


def services_to_restart(processes: dict[str, subprocess.Popen], address_of: Callable[[str], str],
                        policy: RestartPolicy, probe_timeout_s: float = 1.0) -> list[tuple[str, str]]:
    """(service, reason) for each running service `policy` says to restart, probing health of live ones."""
    due = []
    for service, process in processes.items():
        returncode = process.poll()
        serving = returncode is None and check_health(address_of(service), timeout_s=probe_timeout_s) is None
        reason = policy.reason(service, returncode, serving, time.monotonic())
        if reason is not None:
            due.append((service, reason))
    return due


def kill(process: subprocess.Popen) -> None:
    """SIGKILL: an unhealthy service may not drain (its loop is dead or stuck); no-op once exited."""
    if process.poll() is None:
        process.kill()
    process.wait()
