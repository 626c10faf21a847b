"""The light client distribution (the repository's root pyproject.toml: tessera.client, tessera.cli, the
tessera.v1 stubs) installed alone into a fresh virtual environment: it pulls no torch, transformers,
triton, fastapi or uvicorn; the library and `tessera generate` answer against the running cluster
with none of them imported; a server command says in one line what to install."""

from __future__ import annotations

import json
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "triton", "fastapi", "uvicorn", "services")

PROBE = """
import json, sys
import tessera.client as tc
with tc.Client(sys.argv[1]) as client:
    answer = client.generate("Say hello", max_tokens=4, temperature=0.0)
print(json.dumps({"text": answer.text, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    """A fresh venv with only the client distribution: its sources copied out of the checkout (as a
    wheel would carry them), so that nothing of services/ is importable from the working directory."""
    root = tmp_path_factory.mktemp("client-dist")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "tessera", source / "tessera", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(source)],
                   check=True, cwd=root, timeout=600)
    return env_dir


def _run(env_dir: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(env_dir / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_the_client_installs_alone(client_venv, tmp_path):
    listed = _run(client_venv, "python", "-m", "pip", "list", "--format", "json", cwd=tmp_path)
    installed = {entry["name"].lower() for entry in json.loads(listed.stdout)}
    assert "tessera" in installed and "grpcio" in installed
    assert installed.isdisjoint({"torch", "transformers", "triton", "fastapi", "uvicorn", "tessera-server"}), installed


def test_library_and_cli_answer_without_the_server_side(client_venv, tmp_path, gateway_address):
    probe = _run(client_venv, "python", "-c", PROBE, gateway_address, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    answer = json.loads(probe.stdout)
    assert answer["text"]
    assert set(answer["modules"]).isdisjoint(HEAVY), answer["modules"]

    generated = _run(client_venv, "tessera", "generate", "Say hello", "--max-tokens", "4", "--temperature", "0",
                     "--address", gateway_address, cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip()


def test_a_server_command_says_what_to_install(client_venv, tmp_path):
    up = _run(client_venv, "tessera", "up", cwd=tmp_path)
    assert up.returncode == 1
    [line] = up.stderr.strip().splitlines()
    assert "tessera-server" in line and "pip install" in line, line
    assert up.stdout == ""

