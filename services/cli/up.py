"""`tessera up`: start the five services on loopback, wait for health, stop them together.

Each service is its own OS process (`python -m services.<name>`), logging to
`$TESSERA_HOME/logs/<name>.log`. Startup order follows dependencies (registry, vision, pooling,
decoder, gateway); `up` returns only when every health check says SERVING, and on Ctrl-C /
SIGTERM it sends SIGTERM to all (each drains), then SIGKILL after a grace period. A service
that exits on its own is restarted (the others keep serving meanwhile), up to MAX_RESTARTS a minute.

Internal hops are authenticated: each `up` writes a fresh token to `<log dir>/internal-token` (mode
0600) and hands every service its path in `$TESSERA_INTERNAL_TOKEN_FILE` (never the token in argv);
the internal ports then refuse callers without it (services/common/auth.py).
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.adapters.config import ADMIN_TOKEN_ENV
from services.common import auth
from services.common.launch import service_env, wait_serving
from services.common.paths import (
    default_adapter_root,
    default_decoder_dir,
    default_embedding_dir,
    tessera_home,
)

SERVICES = ("adapters", "vision", "pooling", "decoder", "gateway")
MAX_RESTARTS = 5          # per RESTART_WINDOW_S, across services, before `up` gives up
RESTART_WINDOW_S = 60.0
PORT_OFFSETS = {"gateway": 0, "vision": 1, "decoder": 2, "pooling": 3, "adapters": 4}


@dataclass
class ClusterSpec:
    host: str = "127.0.0.1"
    base_port: int = 50051
    decoder_model_dir: Path = field(default_factory=default_decoder_dir)
    embedding_model_dir: Path = field(default_factory=default_embedding_dir)
    reranker_dir: Path | None = None  # a cross-encoder checkpoint; None = bi-encoder rerank
    adapter_root: Path = field(default_factory=default_adapter_root)
    admin_token: str = ""
    vision: bool = True
    mrope_section: str = "8,12,12"
    image_token: str = "<empty_output>"
    log_dir: Path = field(default_factory=lambda: tessera_home() / "logs")
    internal_auth: bool = True  # a per-cluster internal token (False: internal ports trust any caller)
    extra_args: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.base_port <= 65535 - len(SERVICES):
            raise ValueError(f"base_port must leave room for {len(SERVICES)} ports below 65536, got {self.base_port}")
        for name in ("decoder_model_dir", "embedding_model_dir"):
            path = Path(getattr(self, name))
            if not (path / "config.json").exists():
                raise ValueError(f"{name} {path} has no config.json; run `tessera models prepare` first")

    def address(self, service: str) -> str:
        return f"{self.host}:{self.base_port + PORT_OFFSETS[service]}"

    @property
    def native_vision(self) -> bool:
        """The decoder checkpoint is a VLM (Qwen2-VL): its own vision tower, sections and image token."""
        config = json.loads((Path(self.decoder_model_dir) / "config.json").read_text())
        return config.get("model_type") == "qwen2_vl"

    def command(self, service: str) -> list[str]:
        a = self.address
        native = self.native_vision
        if native:  # the checkpoint's vision tower; sections and placeholders come from its config
            vision = ["--encoder", "qwen2-vl", "--model-dir", str(self.decoder_model_dir)]
            decoder_vision: list[str] = []
        else:  # the demo encoder, sized for the decoder, with the configured sections and placeholder
            vision = ["--decoder-model-dir", str(self.decoder_model_dir), "--mrope-section", self.mrope_section]
            decoder_vision = ["--mrope-section", self.mrope_section, "--image-token", self.image_token]
        args = {
            "adapters": ["--root", str(self.adapter_root), "--base-model-dir", str(self.decoder_model_dir)],
            "vision": vision,
            "pooling": ["--model-dir", str(self.embedding_model_dir),
                        *(["--reranker-dir", str(self.reranker_dir)] if self.reranker_dir else [])],
            "decoder": ["--model-dir", str(self.decoder_model_dir), "--adapters-address", a("adapters"),
                        *(decoder_vision if self.vision else [])],
            "gateway": ["--decoder", a("decoder"), "--pooling", a("pooling"), "--adapters", a("adapters"),
                        "--vision", a("vision") if self.vision else ""],
        }[service]
        return [sys.executable, "-m", f"services.{service}", "--address", a(service), *args,
                *self.extra_args.get(service, [])]

    def services(self) -> list[str]:
        return [s for s in SERVICES if self.vision or s != "vision"]


class Cluster:
    """The running processes. Use as a context manager, or `start()` / `stop()`."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.processes: dict[str, subprocess.Popen] = {}
        self.token_file: Path | None = None  # the cluster's internal token, written by `start`

    def start(self, timeout_s: float = 300.0) -> None:
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        self.spec.adapter_root.mkdir(parents=True, exist_ok=True)
        if self.spec.internal_auth:
            self.token_file = auth.write_token_file(self.spec.log_dir)
        try:
            for service in self.spec.services():
                self._spawn(service)
            deadline = time.monotonic() + timeout_s
            for service in self.spec.services():
                self._wait_serving(service, deadline)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, service: str) -> None:
        with open(self.spec.log_dir / f"{service}.log", "ab") as log:
            self.processes[service] = subprocess.Popen(
                self.spec.command(service), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=service_env(self._env(service)))

    def _env(self, service: str) -> dict[str, str]:
        """Secrets travel by environment, never argv (which every local user can read in ps)."""
        env = {auth.INTERNAL_TOKEN_FILE_ENV: str(self.token_file)} if self.token_file else {}
        if service == "adapters" and self.spec.admin_token:
            env[ADMIN_TOKEN_ENV] = self.spec.admin_token
        return env

    def restart(self, service: str, timeout_s: float = 300.0) -> None:
        """Start a service that exited again, and wait until it is SERVING."""
        self._spawn(service)
        self._wait_serving(service, time.monotonic() + timeout_s)

    def _wait_serving(self, service: str, deadline: float) -> None:
        wait_serving(self.spec.address(service), self.processes[service], max(0.0, deadline - time.monotonic()),
                     service, lambda: self.log_tail(service))

    def log_tail(self, service: str, lines: int = 30) -> str:
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

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_until_signalled(spec: ClusterSpec) -> int:
    """Start, print endpoints, restart a service that dies, and stop all on Ctrl-C / SIGTERM."""
    cluster = Cluster(spec)
    stop = {"signalled": False}

    def on_signal(signum, frame):
        stop["signalled"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print("starting " + ", ".join(spec.services()) + f" (logs in {spec.log_dir})", flush=True)
    cluster.start()
    for service in spec.services():
        print(f"  {service:<9} {spec.address(service)}  SERVING", flush=True)
    print(f"tessera is up: gateway at {spec.address('gateway')} (Ctrl-C to stop)", flush=True)
    code = 0
    restarts: list[float] = []
    while not stop["signalled"]:
        dead = [s for s, p in cluster.processes.items() if p.poll() is not None]
        for service in dead:
            # One service down must not take the others with it: the gateway answers UNAVAILABLE
            # for that service meanwhile; we restart it, unless it keeps dying.
            returncode = cluster.processes[service].returncode
            restarts = [t for t in restarts if time.monotonic() - t < RESTART_WINDOW_S] + [time.monotonic()]
            if len(restarts) > MAX_RESTARTS:
                print(f"{service} exited (code {returncode}); {MAX_RESTARTS} restarts within "
                      f"{RESTART_WINDOW_S:.0f} s already, giving up:\n{cluster.log_tail(service)}",
                      file=sys.stderr, flush=True)
                code = 1
                break
            print(f"{service} exited unexpectedly (code {returncode}); restarting it", file=sys.stderr, flush=True)
            try:
                cluster.restart(service)
                print(f"  {service:<9} {spec.address(service)}  SERVING again", flush=True)
            except (RuntimeError, TimeoutError) as error:
                print(f"{service} failed to restart: {error}", file=sys.stderr, flush=True)
                code = 1
                break
        if code:
            break
        time.sleep(0.5)
    print("stopping tessera", flush=True)
    cluster.stop()
    return code


def parse_extra(values: list[str]) -> dict[str, list[str]]:
    """`--service-args decoder="--num-blocks 64"` -> {"decoder": ["--num-blocks", "64"]}."""
    out: dict[str, list[str]] = {}
    for value in values:
        service, sep, args = value.partition("=")
        if not sep or service not in SERVICES:
            raise ValueError(f"--service-args wants SERVICE=ARGS with SERVICE in {SERVICES}, got {value!r}")
        out.setdefault(service, []).extend(shlex.split(args))
    return out
