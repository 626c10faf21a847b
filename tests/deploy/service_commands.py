"""Shared by the compose and Kubernetes checks: run a deploy file's container command through the
service's own argparse parser, with the image's paths mapped onto this machine's."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

from services.common.launch import REPO
from tessera.paths import models_dir

SERVICES = ("gateway", "vision", "decoder", "pooling", "adapters")
GRPC_SERVICE = {"gateway": "tessera.v1.Gateway", "vision": "tessera.v1.Vision", "decoder": "tessera.v1.Decoder",
                "pooling": "tessera.v1.Pooling", "adapters": "tessera.v1.Adapters"}
IMAGE_HOME = "/var/lib/tessera"          # TESSERA_HOME in deploy/Dockerfile
IMAGE_MODELS = f"{IMAGE_HOME}/models"
TOKEN_FILE = "/run/secrets/tessera-internal-token"
DEPLOY = REPO / "deploy"
# flags whose value is a path inside the container (each must lie on a mounted volume)
PATH_FLAGS = ("--model-dir", "--decoder-model-dir", "--base-model-dir", "--root", "--db", "--reranker-dir",
              "--judge-dir", "--dir")


def tool(name: str) -> str:
    """A checker installed by the project: the venv's console scripts first, then PATH."""
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.exists() else shutil.which(name)
    assert found, f"{name} is not installed; `make setup` installs it (Makefile)"
    return found


def run(command: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=120, cwd=REPO)


def module_of(command: list[str]) -> str:
    """`python -m services.<name> ...` -> name."""
    assert command[:2] == ["python", "-m"] and command[2].startswith("services."), command
    name = command[2].removeprefix("services.")
    assert name in SERVICES, command
    return name


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


def host_port(target: str) -> tuple[str, int]:
    """A gRPC target ("host:port", "dns:///host:port") -> (host, port)."""
    address = target.split("///", 1)[1] if target.startswith("dns:") else target
    host, _, port = address.rpartition(":")
    return host, int(port)


def localize(argv: list[str], scratch: Path) -> list[str]:
    """The image's paths as this machine has them: the prepared models for IMAGE_MODELS, `scratch`
    for the rest of IMAGE_HOME (the adapter root, the catalog)."""
    out = []
    for arg in argv:
        if arg.startswith(IMAGE_MODELS):
            arg = str(models_dir()) + arg.removeprefix(IMAGE_MODELS)
        elif arg.startswith(IMAGE_HOME):
            arg = str(scratch) + arg.removeprefix(IMAGE_HOME)
        out.append(arg)
    return out


def parse_command(command: list[str], scratch: Path):
    """Parse a container command with its service's own parser (the one `python -m tessera.<name>`
    runs), so every flag, value and cross-check (model dirs, M-RoPE sections vs head_dim) is the
    service's. Returns (service name, bind address, config object)."""
    name = module_of(command)
    main = importlib.import_module(f"services.{name}.__main__")
    argv = localize(command[3:], scratch)
    config = main.parse_args(argv)
    return name, config.address, config
