"""`tessera up`: start the five services on loopback, wait for health, stop them together.

Each service is its own OS process (`python -m tessera.<name>`); `up` copies its stdout and stderr
to `<log dir>/<name>.log`, rotated by size (tessera/cli/logfiles.py), in the `--log-format` every
service is given. Startup order follows dependencies (registry, vision, pooling, decoder,
gateway); `up` returns only when every health check says SERVING. A process that exits or is not
SERVING in time fails the start: `StartupError` names it, its one-line cause and its last log
lines, and the others are stopped. Only this first start is all-or-nothing (a cluster that never
came up has served nothing, and the cause is most often its configuration); `--cluster` and the
ports (`ClusterSpec`) and the flags of `--service-args` and of the models' served names and
sampling defaults (`check_service_args`) are checked before any process starts. On Ctrl-C /
SIGTERM it sends SIGTERM to all (each drains), then SIGKILL after a grace period.

Once up, the cluster runs until Ctrl-C / SIGTERM: `up` never stops it on its own (`Supervisor`).
A process that exits, or whose health has not said SERVING for UNHEALTHY_RESTART_S (its engine
loop died or is wedged), is killed and started again, as an orchestrator's liveness probe would,
while the others keep serving. A start that fails (it exits, or is not SERVING within
START_TIMEOUT_S) is retried with a backoff of its own, as Kubernetes' CrashLoopBackOff:
BACKOFF_FIRST_S, doubling up to BACKOFF_MAX_S, and BACKOFF_FIRST_S again once the process has
served BACKOFF_RESET_S in a row. Each failure is one line on stderr: the process, the cause, the
next try.

Replicas (`num_decoders`, `num_poolers`) are processes of their own, named `decoder`, `decoder-2`,
...: the first replica of each keeps the service's usual port (base + PORT_OFFSETS), the others
take the ports after the five, decoders' first, then poolers'. The gateway gets the same kind of
target a Kubernetes or compose deployment gives it, an `ipv4:a:p,b:p` list of every replica
(services/gateway/replicas.py), and balances over them itself. Every process also serves
Prometheus /metrics on its gRPC port + METRICS_PORT_OFFSET (`--metrics-port`); once all are SERVING,
`up` prints them and writes `<log dir>/endpoints.json`, which `tessera info` lists, and removes it
when it stops.

Which vision encoder, if any, the decoder gets is decided once from its checkpoint
(`ClusterSpec.encoder`, tessera/cli/topology.py): a user's text-only Llama or Qwen starts
text-only, with no vision service. A directory that is not a decoder checkpoint is refused before
any process starts (`check_decoder_dir`).

Internal hops are authenticated: each `up` writes a fresh token to `<log dir>/internal-token` (mode
0600) and hands every service its path in `$TESSERA_INTERNAL_TOKEN_FILE` (never the token in argv);
the internal ports then refuse callers without it (services/common/auth.py).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.adapters.config import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE_ENV
from services.common import auth
from services.common.checkpoint import CheckpointConfig
from services.common.healthcheck import check as check_health
from services.common.launch import service_env
from services.common.logs import LOG_FORMATS, LOG_LEVELS
from services.common.server import DEFAULT_PORTS
from tessera.cli.endpoints import ENDPOINTS_FILE
from tessera.cli.logfiles import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, ServiceLog, StartupError, failure_cause
from tessera.cli.topology import check_model_dirs, pick_encoder
from tessera.paths import (
    cluster_home,
    default_adapter_root,
    default_decoder_dir,
    default_embedding_dir,
)

SERVICES = ("adapters", "vision", "pooling", "decoder", "gateway")
UNHEALTHY_RESTART_S = 30.0  # NOT_SERVING (or no health answer) this long -> killed and restarted
START_TIMEOUT_S = 300.0  # a process not SERVING this long after it was started failed to start
BACKOFF_FIRST_S = 1.0  # a failed process is started again this long after its first failure,
BACKOFF_MAX_S = 60.0  # twice as long after each next one, at most this long,
BACKOFF_RESET_S = 120.0  # and after BACKOFF_FIRST_S again once it has been SERVING this long in a row
CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a directory of its own under $TESSERA_HOME/clusters
PORT_OFFSETS = {service: port - DEFAULT_PORTS["gateway"] for service, port in DEFAULT_PORTS.items()}
REPLICATED = ("decoder", "pooling")
METRICS_PORT_OFFSET = 100  # a process's Prometheus port: its gRPC port + this
STARTUP_TAIL_LINES = 15  # of a failed service's log, printed by `up`


def service_of(instance: str) -> str:
    """`decoder-2` -> `decoder`: the service a process (replica) runs."""
    return instance.split("-", 1)[0]


@dataclass
class ClusterSpec:
    host: str = "127.0.0.1"
    base_port: int = DEFAULT_PORTS["gateway"]
    decoder_model_dir: Path = field(default_factory=default_decoder_dir)
    embedding_model_dir: Path = field(default_factory=default_embedding_dir)
    reranker_dir: Path | None = None  # a cross-encoder checkpoint; None = bi-encoder rerank
    adapter_root: Path = field(default_factory=default_adapter_root)
    admin_token: str = ""
    vision: bool = True  # False: text-only whatever the decoder (no vision service), as `--no-vision`
    mrope_section: str = ""  # pairs the demo encoder with the decoder; "" = derived (see `encoder`)
    image_token: str = "<empty_output>"  # the demo encoder's image placeholder in the decoder's vocabulary
    served_model_name: tuple[str, ...] = ()  # the decoder's --served-model-name NAME [ALIAS ...]; () = its dir's name
    generation_config: str = ""  # the decoder's --generation-config (auto, vllm or a directory); "" = its default
    embedding_served_model_name: tuple[str, ...] = ()  # the pooling service's --served-model-name (embedding model)
    cluster: str = ""  # the cluster's name: its home is cluster_home(cluster); "" = the gateway's port
    log_dir: Path | None = None  # None = cluster_home(cluster) / "logs"
    log_format: str = "text"  # every service's --log-format: text or json lines
    log_level: str = "INFO"
    log_max_bytes: int = DEFAULT_MAX_BYTES  # a process's log file is rotated at this size
    log_backups: int = DEFAULT_BACKUPS  # rotated files kept: <name>.log.1 .. .N
    internal_auth: bool = True  # a per-cluster internal token (False: internal ports trust any caller)
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    num_decoders: int = 1
    num_poolers: int = 1
    http_port: int = 0  # the gateway's HTTP API on `host` (0 = off; the `tessera up` command asks 8000)
    checkpoint: CheckpointConfig = field(init=False, repr=False, compare=False)  # the decoder's config.json
    encoder: str | None = field(init=False)  # the vision encoder: "qwen2-vl", "demo", or None (text-only)

    def __post_init__(self) -> None:
        self.cluster = self.cluster or str(self.base_port)
        if not CLUSTER_NAME.fullmatch(self.cluster):
            raise ValueError(f"cluster must be a plain name ({CLUSTER_NAME.pattern}: it names a directory under "
                             f"$TESSERA_HOME/clusters), got {self.cluster!r}")
        if self.log_dir is None:
            self.log_dir = cluster_home(self.cluster) / "logs"
        if self.log_format not in LOG_FORMATS or self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS} and log_level one of {LOG_LEVELS}, "
                             f"got {self.log_format!r} and {self.log_level!r}")
        if self.log_max_bytes < 1 or self.log_backups < 0:
            raise ValueError(f"log_max_bytes must be >= 1 and log_backups >= 0, got {self.log_max_bytes} "
                             f"and {self.log_backups}")
        for name in ("num_decoders", "num_poolers"):
            if not 1 <= getattr(self, name) <= 64:
                raise ValueError(f"{name} must be in 1..64, got {getattr(self, name)}")
        if not 1 <= self.base_port <= 65535 - self.num_ports - METRICS_PORT_OFFSET:
            raise ValueError(f"base_port must leave room for {self.num_ports} ports and their metrics ports "
                             f"(+{METRICS_PORT_OFFSET}) below 65536, got {self.base_port}")
        self._check_http_port()
        if self.num_decoders + self.num_poolers > 2:
            try:
                ipaddress.ip_address(self.host)
            except ValueError:
                raise ValueError(f"replicas need host to be an IP address (the gateway's ipv4:/ipv6: target), "
                                 f"got {self.host!r}") from None
        self.checkpoint = check_model_dirs(self.decoder_model_dir, self.embedding_model_dir)
        self.encoder, sections = pick_encoder(self.checkpoint, self.mrope_section) if self.vision else (None, "")
        self.mrope_section = sections or self.mrope_section

    def _check_http_port(self) -> None:
        """The gateway's HTTP port: 0 (off) or a TCP port none of the cluster's gRPC and metrics ports take."""
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be 0 (off) or a TCP port in 1..65535, got {self.http_port}")
        grpc_ports = range(self.base_port, self.base_port + self.num_ports)
        if self.http_port in grpc_ports or self.http_port - METRICS_PORT_OFFSET in grpc_ports:
            raise ValueError(f"http_port {self.http_port} is taken by the cluster's gRPC ports "
                             f"{grpc_ports.start}..{grpc_ports.stop - 1} or their metrics ports "
                             f"(+{METRICS_PORT_OFFSET})")

    @property
    def catalog_path(self) -> Path:
        """The registry's SQLite catalog: one per cluster, so clusters on a host list only their own adapters."""
        return cluster_home(self.cluster) / "registry" / "catalog.sqlite3"

    @property
    def num_ports(self) -> int:
        return len(SERVICES) + self.num_decoders - 1 + self.num_poolers - 1

    def replicas(self, service: str) -> list[str]:
        """Process names of `service`'s replicas: the service's name, then `<service>-2`, ..."""
        count = {"decoder": self.num_decoders, "pooling": self.num_poolers}.get(service, 1)
        return [service] + [f"{service}-{i}" for i in range(2, count + 1)]

    def address(self, instance: str) -> str:
        """host:port of a service or replica (`decoder-2`)."""
        service, _, number = instance.partition("-")
        if not number or number == "1":
            return f"{self.host}:{self.base_port + PORT_OFFSETS[service]}"
        index = int(number) - 2 + (self.num_decoders - 1 if service == "pooling" else 0)
        return f"{self.host}:{self.base_port + len(SERVICES) + index}"

    def metrics_url(self, instance: str) -> str:
        """Where a service or replica serves Prometheus /metrics (its gRPC port + METRICS_PORT_OFFSET)."""
        host, _, port = self.address(instance).rpartition(":")
        return f"http://{host}:{int(port) + METRICS_PORT_OFFSET}/metrics"

    def target(self, service: str) -> str:
        """The gateway's target for every replica of `service` (one address, or an ipv4:/ipv6: list)."""
        addresses = [self.address(r) for r in self.replicas(service)]
        if len(addresses) == 1:
            return addresses[0]
        scheme = "ipv6" if ipaddress.ip_address(self.host).version == 6 else "ipv4"
        return f"{scheme}:{','.join(addresses)}"

    @property
    def native_vision(self) -> bool:
        """The decoder checkpoint is a VLM (Qwen2-VL): its own vision tower, sections and image token."""
        return self.checkpoint.model_type == "qwen2_vl"

    def command(self, instance: str) -> list[str]:
        """The command line of a service or replica process."""
        service = service_of(instance)
        a = self.address
        vision: list[str] = []
        decoder_vision: list[str] = []  # none: text-only, or Qwen2-VL's sections from its own config
        if self.encoder == "qwen2-vl":  # the checkpoint's vision tower; sections and placeholders from its config
            vision = ["--encoder", "qwen2-vl", "--model-dir", str(self.decoder_model_dir)]
        elif self.encoder == "demo":  # the demo encoder, sized for the decoder, with the sections and placeholder
            vision = ["--decoder-model-dir", str(self.decoder_model_dir), "--mrope-section", self.mrope_section]
            decoder_vision = ["--mrope-section", self.mrope_section, "--image-token", self.image_token]
        args = {
            "adapters": ["--root", str(self.adapter_root), "--base-model-dir", str(self.decoder_model_dir),
                         "--db", str(self.catalog_path)],
            "vision": vision,
            "pooling": ["--model-dir", str(self.embedding_model_dir),
                        *(["--reranker-dir", str(self.reranker_dir)] if self.reranker_dir else []),
                        *_names_flag(self.embedding_served_model_name)],
            "decoder": ["--model-dir", str(self.decoder_model_dir), "--adapters-address", a("adapters"),
                        *decoder_vision, *_names_flag(self.served_model_name),
                        *(["--generation-config", self.generation_config] if self.generation_config else [])],
            "gateway": ["--decoder", self.target("decoder"), "--pooling", self.target("pooling"),
                        "--adapters", a("adapters"),
                        "--vision", a("vision") if self.encoder else "", "--http-port", str(self.http_port)],
        }[service]
        metrics_port = int(a(instance).rpartition(":")[2]) + METRICS_PORT_OFFSET
        return [sys.executable, "-m", f"services.{service}", "--address", a(instance), *args,
                "--metrics-port", str(metrics_port), "--log-format", self.log_format, "--log-level", self.log_level,
                *self.extra_args.get(service, [])]

    def services_given_flags(self) -> set[str]:
        """The services whose command line carries flags the user gave: `--service-args`, and the
        decoder's and pooling's model names and sampling defaults (`check_service_args` parses them)."""
        given = set(self.extra_args)
        if self.served_model_name or self.generation_config:
            given.add("decoder")
        if self.embedding_served_model_name:
            given.add("pooling")
        return given

    def environment(self, instance: str) -> dict[str, str]:
        """Environment overrides of a process: replicas of one service share the CPUs (each gets
        cpu_count / replicas intra-op threads) unless the caller set OMP_NUM_THREADS."""
        service = service_of(instance)
        replicas = len(self.replicas(service))
        if replicas == 1 or "OMP_NUM_THREADS" in os.environ:
            return {}
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // replicas))}

    def services(self) -> list[str]:
        """Every process to run, replicas included, in start order."""
        return [r for s in SERVICES if self.encoder or s != "vision" for r in self.replicas(s)]


class Cluster:
    """The running processes. Use as a context manager, or `start()` / `stop()`."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, ServiceLog] = {}  # each process's rotated log file
        self.token_file: Path | None = None  # the cluster's internal token, written by `start`
        self._endpoints: str | None = None  # endpoints.json as `start` wrote it; `stop` removes it

    def start(self, timeout_s: float = START_TIMEOUT_S, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Start every process and wait until all are SERVING, or until `interrupted()` says so;
        then write endpoints.json.

        Raises:
            StartupError: a process exited or was not SERVING within `timeout_s` seconds (all are
                stopped first).
            StartInterrupted: `interrupted()` turned true first (all are stopped first).
        """
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
                                   stdin=subprocess.DEVNULL, env=self._environment(service))
        log.follow(process.stdout)
        self.processes[service] = process

    def _environment(self, service: str) -> dict[str, str]:
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

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class StartInterrupted(Exception):
    """Ctrl-C or SIGTERM while the cluster was starting."""


def run_until_signalled(spec: ClusterSpec) -> int:
    """Start, print endpoints, keep every process running (`Supervisor`) and stop all on Ctrl-C /
    SIGTERM. Returns 0 (stopped by a signal), 1 (a service failed to start) or 130 (interrupted
    while starting)."""
    cluster = Cluster(spec)
    stop = {"signalled": False}

    def on_signal(signum, frame):
        stop["signalled"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print("starting " + ", ".join(spec.services()) + f" (logs in {spec.log_dir})", flush=True)
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
            _kill(self.cluster.processes[name])
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
            _kill(process)
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


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL: an unhealthy service may not drain (its loop is dead or stuck); no-op once exited."""
    if process.poll() is None:
        process.kill()
    process.wait()


def _names_flag(names: tuple[str, ...]) -> list[str]:
    """`--served-model-name NAME ALIAS...` when names are given (vLLM's flag), else nothing."""
    return ["--served-model-name", *names] if names else []


def write_endpoints(spec: ClusterSpec) -> str:
    """Write `<log dir>/endpoints.json`: the gateway's address and each process's gRPC address and
    metrics URL. Returns the text written."""
    endpoints = {"gateway": spec.address("gateway"),
                 "services": {name: {"address": spec.address(name), "metrics": spec.metrics_url(name)}
                              for name in spec.services()}}
    text = json.dumps(endpoints, indent=2) + "\n"
    (spec.log_dir / ENDPOINTS_FILE).write_text(text)
    return text


def parse_extra(values: list[str]) -> dict[str, list[str]]:
    """`--service-args decoder="--num-blocks 64"` -> {"decoder": ["--num-blocks", "64"]}."""
    out: dict[str, list[str]] = {}
    for value in values:
        service, sep, args = value.partition("=")
        if not sep or service not in SERVICES:  # applies to every replica of the service
            raise ValueError(f"--service-args wants SERVICE=ARGS with SERVICE in {SERVICES}, got {value!r}")
        try:
            words = shlex.split(args)
        except ValueError as exc:  # "No closing quotation", "No escaped character"
            raise ValueError(f"--service-args {value!r}: {exc} (ARGS are split as a POSIX shell would)") from None
        out.setdefault(service, []).extend(words)
    return out


# Run by `check_service_args` in a child process: each service's own parser, on its whole command line.
_PARSE_SERVICE_ARGS = """
import contextlib, importlib, io, json, sys
for service, argv in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            importlib.import_module(f"services.{service}.__main__").build_parser().parse_args(argv)
    except SystemExit as exit_:
        if exit_.code:
            print(service, (stderr.getvalue().strip().splitlines() or [str(exit_.code)])[-1])
            break
"""


def check_service_args(spec: ClusterSpec, timeout_s: float = 120.0) -> None:
    """Refuse a `--service-args` flag its service does not know, or a value its parser cannot read
    (`up`'s own decoder and pooling flags too: `ClusterSpec.services_given_flags`), before any
    process starts: the command line of each service given some is parsed by the
    service's own parser, in one child process (the parsers come with the services' code, torch
    included; `up` does not keep that in memory). Values a service checks when it builds its config
    (a limit out of range) still fail its start. Nothing to check, nothing is run.

    Raises:
        ValueError: one line, the service and its parser's error.
    """
    given = spec.services_given_flags()
    commands = [(name, spec.command(name)[3:]) for name in spec.services()
                if name in given]  # a service's first replica; the others differ only in ports
    if not commands:
        return
    try:
        done = subprocess.run([sys.executable, "-c", _PARSE_SERVICE_ARGS, json.dumps(commands)], capture_output=True,
                              text=True, timeout=timeout_s, env=service_env(), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return  # each service parses its flags again when it starts
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ValueError(f"--service-args could not be checked: {last}")
    if done.stdout.strip():
        service, _, error = done.stdout.strip().partition(" ")
        raise ValueError(f"--service-args {service}: {error}")
