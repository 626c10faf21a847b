"""Process control of `tessera up`: start the processes of a `ClusterSpec`, wait for health, stop
them together (`Cluster`).

Each service is its own OS process (`python -m services.<name>`); its stdout and stderr are copied
to `<log dir>/<name>.log`, rotated by size (tessera/cli/logfiles.py), in the `--log-format` every
service is given. Startup order follows dependencies (registry, vision, pooling, decoder,
gateway); `start` returns only when every health check says SERVING. A process that exits or is
not SERVING in time fails the start: `StartupError` names it, its one-line cause and its last log
lines, and the others are stopped. Only this first start is all-or-nothing (a cluster that never
came up has served nothing, and the cause is most often its configuration). `stop` sends SIGTERM
to all (each drains), then SIGKILL after a grace period.

Before it writes or starts anything, `start` takes the cluster's name and checks its ports
(`claim`, tessera/cli/up/claim.py): a cluster of that name running, or a port in use, raises
`ClusterBusy` and leaves the running cluster's files alone. `stop` gives the name back.

Once all are SERVING, `start` writes `<log dir>/endpoints.json`, which `tessera info` lists, and
`stop` removes it.

Internal hops are authenticated: each start writes a fresh token to `<log dir>/internal-token`
(mode 0600) and hands every service its path in `$TESSERA_INTERNAL_TOKEN_FILE` (never the token in
argv); the internal ports then refuse callers without it (services/common/auth.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from services.adapters.config import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV
from services.common import auth
from services.common.healthcheck import check as check_health
from services.common.launch import service_env
from tessera.cli.endpoints import ENDPOINTS_FILE
from tessera.cli.logfiles import ServiceLog, StartupError, failure_cause
from tessera.cli.up.claim import Claim, claim
from tessera.cli.up.spec import ClusterSpec, service_of

START_TIMEOUT_S = 300.0  # a process not SERVING this long after it was started failed to start
STARTUP_TAIL_LINES = 15  # of a failed service's log, printed by `up`


class Cluster:
    """The running processes. Use as a context manager, or `start()` / `stop()`."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, ServiceLog] = {}  # each process's rotated log file
        self.token_file: Path | None = None  # the cluster's internal token, written by `start`
        self._endpoints: str | None = None  # endpoints.json as `start` wrote it; `stop` removes it
        self._claim: Claim | None = None  # the cluster's name, held from `claim` to `stop`

    def claim(self) -> None:
        """Take the cluster's name and check its ports, before anything is written (claim.py); `start`
        does it when not done yet. Idempotent.

        Raises:
            ClusterBusy: the cluster runs already, or a port it needs is in use.
        """
        if self._claim is None:
            self._claim = claim(self.spec)

    def start(self, timeout_s: float = START_TIMEOUT_S, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Start every process and wait until all are SERVING, or until `interrupted()` says so;
        then write endpoints.json.

        Raises:
            ClusterBusy: the cluster runs already, or a port it needs is in use (nothing written).
            StartupError: a process exited or was not SERVING within `timeout_s` seconds (all are
                stopped first).
            StartInterrupted: `interrupted()` turned true first (all are stopped first).
        """
        self.claim()
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        self.spec.adapter_root.mkdir(parents=True, exist_ok=True)
        if self.spec.internal_auth:
            self.token_file = auth.write_token_file(self.spec.log_dir)
        try:
            for service in self.spec.services():
                self.spawn(service)
            self._wait_serving(self.spec.services(), timeout_s, interrupted)
        except BaseException:
            self.stop()
            raise
        self._endpoints = write_endpoints(self.spec)

    def spawn(self, service: str) -> None:
        """Start the process of a service or replica, its output followed into its log; no wait.

        Raises:
            OSError: the process could not be created.
        """
        log = self.logs.get(service)
        if log is None:
            log = self.logs[service] = ServiceLog(self.spec.log_dir / f"{service}.log", self.spec.log_max_bytes,
                                                  self.spec.log_backups)
        process = subprocess.Popen(self.spec.command(service), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=self.process_environment(service))
        log.follow(process.stdout)
        self.processes[service] = process

    def process_environment(self, service: str) -> dict[str, str]:
        """The process's whole environment; secrets a service has no use for are left out, also when
        the caller's shell exports them."""
        env = service_env(self._env(service))
        env.pop(ADMIN_TOKEN_FILE_ENV, None)  # `up` read it; the registry gets the token in ADMIN_TOKEN_ENV
        if service_of(service) != "adapters":
            env.pop(ADMIN_TOKEN_ENV, None)
        if not self.token_file:
            env.pop(auth.INTERNAL_TOKEN_FILE_ENV, None)
        return env

    def _env(self, service: str) -> dict[str, str]:
        """Secrets travel by environment, never argv (which every local user can read in ps)."""
        env = self.spec.environment(service)
        if self.token_file:
            env[auth.INTERNAL_TOKEN_FILE_ENV] = str(self.token_file)
        if service_of(service) == "adapters" and self.spec.admin_token:
            env[ADMIN_TOKEN_ENV] = self.spec.admin_token
        return env

    def restart(self, service: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start a service that exited again, and wait until it is SERVING.

        Raises:
            StartupError: it exited again or was not SERVING within `timeout_s` seconds.
        """
        self.spawn(service)
        self._wait_serving([service], timeout_s)

    def _wait_serving(self, services: list[str], timeout_s: float,
                      interrupted: Callable[[], bool] = lambda: False) -> None:
        """Poll every process of `services` until each says SERVING; the first to exit fails the
        start at once (the others are not waited for first). Checked before each process: Ctrl-C
        reaches the services too, and one dying of it is no failure of its own."""
        deadline = time.monotonic() + timeout_s
        pending = list(services)
        while pending:
            for service in list(pending):
                if interrupted():
                    raise StartInterrupted
                if self.processes[service].poll() is not None:
                    raise self.startup_error(service, f"exited with code {self.processes[service].returncode}")
                if check_health(self.spec.address(service), timeout_s=1.0) is None:
                    pending.remove(service)
            if pending and time.monotonic() > deadline:
                raise self.startup_error(pending[0], f"not SERVING after {timeout_s:.0f} s")
            if pending:
                time.sleep(0.2)

    def startup_error(self, service: str, reason: str) -> StartupError:
        """What a process that failed to start (`reason`: "exited with code 1") said last."""
        log = self.logs[service]
        exited = self.processes[service].poll() is not None
        if exited:
            log.drain()  # its last words are still in the pipe
        lines = log.recent()
        return StartupError(service, reason, failure_cause(lines, exited), lines[-STARTUP_TAIL_LINES:], log.path)

    def log_tail(self, service: str, lines: int = 30) -> str:
        """The last `lines` lines of the process's current log file."""
        path = self.spec.log_dir / f"{service}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self, grace_s: float = 10.0) -> None:
        for process in reversed(list(self.processes.values())):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        for log in self.logs.values():
            log.close()
        self.logs.clear()
        path = self.spec.log_dir / ENDPOINTS_FILE
        if self._endpoints is not None and path.is_file() and path.read_text() == self._endpoints:
            path.unlink()  # only as written here: another `up` of this cluster's name may have rewritten it
        self._endpoints = None
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class StartInterrupted(Exception):
    """Ctrl-C or SIGTERM while the cluster was starting."""


def write_endpoints(spec: ClusterSpec) -> str:
    """Write `<log dir>/endpoints.json`: the gateway's address, each process's gRPC address and
    metrics URL, and with an HTTP port the API's /metrics. Returns the text written."""
    endpoints = {"gateway": spec.address("gateway"),
                 "services": {name: {"address": spec.address(name), "metrics": spec.metrics_url(name)}
                              for name in spec.services()}}
    if spec.http_port:
        endpoints["http_metrics"] = f"http://{spec.host}:{spec.http_port}/metrics"
    text = json.dumps(endpoints, indent=2) + "\n"
    (spec.log_dir / ENDPOINTS_FILE).write_text(text)
    return text
