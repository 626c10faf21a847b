"""The cluster `tessera up` runs, checked before any process starts: which processes, their ports,
command lines and environments (`ClusterSpec`).

Replicas (`num_decoders`, `num_poolers`) are processes of their own, named `decoder`, `decoder-2`,
...: the first replica of each keeps the service's usual port (base + PORT_OFFSETS), the others
take the ports after the five, decoders' first, then poolers'. The gateway gets the same kind of
target a Kubernetes or compose deployment gives it, an `ipv4:a:p,b:p` list of every replica
(services/gateway/replicas.py), and balances over them itself. Every process also serves
Prometheus /metrics on its gRPC port + METRICS_PORT_OFFSET (`--metrics-port`).

Which vision encoder, if any, the decoder gets is decided once from its checkpoint
(`ClusterSpec.encoder`, tessera/cli/topology.py): a user's text-only Llama or Qwen starts
text-only, with no vision service. A directory that is not a decoder checkpoint is refused before
any process starts (`check_model_dirs`). `--cluster` and the ports are checked by `ClusterSpec`,
the flags of `--service-args` and of the models' served names and sampling defaults by
`check_service_args`. API keys for the gateway (`--service-args gateway=--api-key-file PATH`, or
`$TESSERA_API_KEY_FILE`, which every service inherits) without an admin token are refused: adapter
load/unload would be open to anyone who reaches the gateway.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from services.common.checkpoint import CheckpointConfig, decoder_impl
from services.common.launch import service_env
from services.common.logs import LOG_FORMATS, LOG_LEVELS
from services.common.mrope import QWEN_VL_MODEL_TYPES
from services.common.server import DEFAULT_PORTS
from tessera.cli.logfiles import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES
from tessera.cli.topology import check_model_dirs, pick_encoder
from tessera.paths import (
    cluster_home,
    default_adapter_root,
    default_decoder_dir,
    default_embedding_dir,
)
from tessera.protocol import ADMIN_TOKEN_ENV, API_KEY_FILE_ENV

SERVICES = ("adapters", "vision", "pooling", "decoder", "gateway")
CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a directory of its own under $TESSERA_HOME/clusters
PORT_OFFSETS = {service: port - DEFAULT_PORTS["gateway"] for service, port in DEFAULT_PORTS.items()}
METRICS_PORT_OFFSET = 100  # a process's Prometheus port: its gRPC port + this


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
    model_impl: str = field(init=False)  # how the decoder runs the model: "native" or "transformers"

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
        self._check_admin_token()
        if self.num_decoders + self.num_poolers > 2:
            try:
                ipaddress.ip_address(self.host)
            except ValueError:
                raise ValueError(f"replicas need host to be an IP address (the gateway's ipv4:/ipv6: target), "
                                 f"got {self.host!r}") from None
        self.checkpoint = check_model_dirs(self.decoder_model_dir, self.embedding_model_dir)
        # the decoder's --model-impl (auto unless --service-args gives it), resolved as the decoder will
        model_impl = _last_flag_value(self.extra_args.get("decoder", []), "--model-impl") or "auto"
        try:
            self.model_impl = decoder_impl(self.checkpoint, model_impl)
        except ValueError as error:
            raise ValueError(f"decoder model dir {str(self.checkpoint.model_dir)!r} {error}") from None
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

    def _check_admin_token(self) -> None:
        """API keys on the gateway need an admin token on the registry (never anonymous admin)."""
        keys = _last_flag_value(self.extra_args.get("gateway", []), "--api-key-file") or os.environ.get(API_KEY_FILE_ENV)
        token = self.admin_token or _last_flag_value(self.extra_args.get("adapters", []), "--admin-token-file")
        if keys and not token:
            raise ValueError(f"the gateway has API keys ({keys}) but the registry has no admin token: adapter "
                             f"load/unload would be open to anonymous callers; pass --admin-token-file PATH "
                             f"(or set ${ADMIN_TOKEN_ENV})")

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

    def ports(self) -> list[PortUse]:
        """Every TCP port the cluster's processes will listen on (gRPC, metrics, the gateway's HTTP),
        each with the flag that sets it, in start order: what `tessera up` checks is free before it
        writes or starts anything (tessera/cli/up/claim.py)."""
        out = []
        for instance in self.services():
            service = service_of(instance)
            host, _, port = self.address(instance).rpartition(":")
            out.append(PortUse(instance, "gRPC", host, int(port), "--base-port"))
            out.append(PortUse(instance, "metrics", host, int(port) + METRICS_PORT_OFFSET, "--base-port"))
            if service == "gateway" and self.http_port:
                out.append(PortUse(instance, "HTTP", host, self.http_port, "--http-port"))
            given = self.extra_args.get(service, [])
            for what, flag in (("metrics", "--metrics-port"), ("HTTP", "--http-port")):
                value = _last_flag_value(given, flag)  # a --service-args flag wins over up's own (argparse: last)
                if value is not None:
                    out = [u for u in out if (u.instance, u.what) != (instance, what)]
                    if value.isdigit() and int(value):
                        out.append(PortUse(instance, what, host, int(value), f"--service-args {service}={flag}"))
        return out

    def target(self, service: str) -> str:
        """The gateway's target for every replica of `service` (one address, or an ipv4:/ipv6: list)."""
        addresses = [self.address(r) for r in self.replicas(service)]
        if len(addresses) == 1:
            return addresses[0]
        scheme = "ipv6" if ipaddress.ip_address(self.host).version == 6 else "ipv4"
        return f"{scheme}:{','.join(addresses)}"

    @property
    def native_vision(self) -> bool:
        """The decoder checkpoint is a VLM (Qwen2-VL, Qwen2.5-VL): its own vision tower, sections and image token."""
        return self.checkpoint.model_type in QWEN_VL_MODEL_TYPES

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


@dataclass(frozen=True)
class PortUse:
    """One port a process of the cluster listens on: `what` is "gRPC", "metrics" or "HTTP"; `flag`
    the `tessera up` flag that sets it."""

    instance: str
    what: str
    host: str
    port: int
    flag: str

    def __str__(self) -> str:
        return f"{self.instance} {self.what} port {self.host}:{self.port}"


def _last_flag_value(argv: list[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in `argv`, or None."""
    value = None
    for index, word in enumerate(argv):
        if word == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif word.startswith(flag + "="):
            value = word.partition("=")[2]
    return value


def _names_flag(names: tuple[str, ...]) -> list[str]:
    """`--served-model-name NAME ALIAS...` when names are given (vLLM's flag), else nothing."""
    return ["--served-model-name", *names] if names else []


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


# Run by `check_service_args` in a child process: each service's own parser, on its whole command line;
# the decoder's whole config (services/decoder/__main__.py parse_args: the checkpoint's family checks).
_PARSE_SERVICE_ARGS = """
import contextlib, importlib, io, json, sys
for service, argv in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            module = importlib.import_module(f"services.{service}.__main__")
            module.parse_args(argv) if service == "decoder" else module.build_parser().parse_args(argv)
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
    included; `up` does not keep that in memory). The decoder's config is built whole there, when
    it has flags or serves a checkpoint other than the built-in one: what its family refuses in
    config.json (a Gemma soft-cap of 0, Mistral's layer_types, a longrope factor list of the wrong
    length) is one line before any service starts. Values other services check when they build
    their config (a limit out of range) still fail their start. Nothing to check, nothing is run.

    Raises:
        ValueError: one line, the service and its parser's error.
    """
    given = spec.services_given_flags()
    if spec.decoder_model_dir != default_decoder_dir():
        given.add("decoder")
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
