"""`tessera up` as a user runs it, with an admin token file and API keys, and the client commands
against it: no secret in any process's argv, generate's --system/--n/--logprobs, `info`, the
reworded refusals, and Ctrl-C during a stream."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cli_testing import free_base_port
from safetensors.torch import save_file

from tessera.cli.up.spec import SERVICES
from tessera.client import Client
from tessera.paths import default_decoder_dir, default_embedding_dir

MAX_MODEL_LEN = 512


@dataclass
class Running:
    address: str
    admin_token: str
    admin_token_file: Path
    api_key: str
    process: subprocess.Popen

    def env(self, **changes: str | None) -> dict[str, str]:
        """The CLI's environment: the cluster's address and API key, `changes` applied (None: unset)."""
        env = {**os.environ, "TESSERA_ADDRESS": self.address, "TESSERA_API_TOKEN": self.api_key}
        env.pop("TESSERA_ADMIN_TOKEN", None)
        env.pop("TESSERA_ADMIN_TOKEN_FILE", None)
        for key, value in changes.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def cli(self, *argv: str, **env: str | None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tessera.cli.main", *argv], capture_output=True, text=True,
                              timeout=120, env=self.env(**env))


def _write_adapter(directory: Path) -> None:
    """A PEFT LoRA on layer 0's q_proj of the default decoder (576 features), rank 4."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.randn(4, 576, generator=generator) * 0.01,
               f"{prefix}.lora_B.weight": torch.randn(576, 4, generator=generator) * 0.01},
              str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"}))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("tessera-home")
    admin_token, api_key = f"admin-{secrets.token_hex(16)}", f"key-{secrets.token_hex(16)}"
    token_file, key_file = home / "admin-token", home / "api-keys"
    token_file.write_text(admin_token + "\n")
    key_file.write_text(api_key + "\n")
    for path in (token_file, key_file):
        path.chmod(0o600)
    _write_adapter(home / "adapters" / "q0")
    base = free_base_port(len(SERVICES))
    env = {**os.environ, "TESSERA_HOME": str(home)}
    env.pop("TESSERA_ADMIN_TOKEN", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "tessera.cli.main", "up", "--base-port", str(base), "--no-vision", "--http-port", "0",
         "--decoder-model-dir", str(default_decoder_dir()), "--embedding-model-dir", str(default_embedding_dir()),
         "--adapter-root", str(home / "adapters"), "--admin-token-file", str(token_file),
         "--service-args", f"decoder=--max-model-len {MAX_MODEL_LEN} --num-blocks 96",
         "--service-args", f"gateway=--api-key-file {key_file}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            pytest.fail("tessera up exited:\n" + "".join(output))
        output.append(line)
        if line.startswith("tessera is up"):
            break
    else:
        process.kill()
        pytest.fail("tessera up did not come up in 300 s:\n" + "".join(output))
    yield Running(f"127.0.0.1:{base}", admin_token, token_file, api_key, process)
    process.send_signal(signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _argv_of_every_process() -> dict[int, str]:
    argv = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # exited meanwhile
                continue
    return argv


def test_no_secret_appears_in_any_process_argv(cluster):
    argv = _argv_of_every_process()
    assert any("-m services.adapters" in text for text in argv.values())  # the registry is among those read
    leaks = {pid: text for pid, text in argv.items() if cluster.admin_token in text or cluster.api_key in text}
    assert leaks == {}


def test_adapter_admin_calls_read_the_token_from_a_file_or_the_environment(cluster):
    refused = cluster.cli("adapters", "load", "q0", "q0")
    assert refused.returncode == 1
    assert refused.stderr == ("error: the adapter registry needs an admin token: set TESSERA_ADMIN_TOKEN or pass "
                              "--admin-token-file PATH (the token `tessera up` was given)\n")
    loaded = cluster.cli("adapters", "load", "q0", "q0", "--admin-token-file", str(cluster.admin_token_file))
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.startswith("loaded q0 rank=4")
    again = cluster.cli("adapters", "load", "q0", "q0", TESSERA_ADMIN_TOKEN=cluster.admin_token)
    assert again.returncode == 1
    assert "pass --replace" in again.stderr and "replace=true" not in again.stderr
    replaced = cluster.cli("adapters", "load", "q0", "q0", "--replace", TESSERA_ADMIN_TOKEN=cluster.admin_token)
    assert replaced.returncode == 0, replaced.stderr
    wrong = cluster.cli("adapters", "unload", "q0", TESSERA_ADMIN_TOKEN="not-the-token")
    assert wrong.returncode == 1 and wrong.stderr.startswith("error: the adapter registry refused the admin token")
    listing = cluster.cli("adapters", "list", "--json")
    assert [a["name"] for a in json.loads(listing.stdout)] == ["q0"]


def test_a_missing_api_key_names_the_variable(cluster):
    result = cluster.cli("tokenize", "hello", TESSERA_API_TOKEN=None)
    assert result.returncode == 1
    assert result.stderr == f"error: the gateway at {cluster.address} needs an API key: set TESSERA_API_TOKEN\n"


def test_generate_system_message_n_choices_and_logprobs(cluster):
    with Client(cluster.address, api_token=cluster.api_key) as client:
        model = client.info().decoder.model
        messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
        expected_prompt = len(client.tokenize(messages=messages, model=model).tokens[0])
    answer = cluster.cli("generate", "Hi", "--system", "Answer in French.", "--max-tokens", "3", "--json")
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout)["usage"]["prompt_tokens"] == expected_prompt  # the system turn went in

    result = cluster.cli("generate", "The capital of France is", "--n", "2", "--temperature", "1.0", "--seed", "3",
                         "--max-tokens", "4", "--logprobs", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    labels = [line for line in lines if line.startswith("[choice ")]
    assert [label.split("]")[0] for label in labels] == ["[choice 0", "[choice 1"]
    tables = [i for i, line in enumerate(lines) if line.startswith("token ")]
    assert len(tables) == 2
    rows = lines[tables[0] + 1:tables[0] + 5]  # max 4 tokens (fewer only when the choice stopped)
    for row in rows:
        if row.startswith("[choice"):
            break
        entries = re.findall(r"\((\d+)\)\s+(-?\d+\.\d+)", row)  # 'text'(id) logprob: the token, 2 alternatives
        assert len(entries) == 3, row
        assert all(float(logprob) <= 0.0 for _, logprob in entries)


def test_info_prints_a_table_and_json(cluster):
    table = cluster.cli("info")
    assert table.returncode == 0, table.stderr
    # label, two spaces or more, value (labels may hold one space: "model impl", "KV cache")
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in table.stdout.splitlines() if "  " in line)
    assert rows["dtype"] and rows["context"] == f"{MAX_MODEL_LEN} tokens"
    assert "smollm2" in rows["model"].lower() and rows["model impl"].startswith("native")
    machine = json.loads(cluster.cli("info", "--json").stdout)
    assert machine["decoder"]["maxModelLen"] == MAX_MODEL_LEN and "vision" not in machine
    assert [r["service"] for r in machine["replicas"]] == ["decoder", "pooling"]


def test_ctrl_c_while_streaming_prints_one_line_and_exits_130(cluster):
    process = subprocess.Popen([sys.executable, "-m", "tessera.cli.main", "generate", "1, 2, 3, 4, 5, 6,",
                                "--max-tokens", str(MAX_MODEL_LEN - 32)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cluster.env(),
                               # a shell running the suite in the background ignores SIGINT and its
                               # children inherit that; a terminal's Ctrl-C reaches a default handler
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = process.stdout.read(1)  # a token has arrived: the stream is open
        assert first, process.stderr.read().decode()
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    assert stderr.decode() == "interrupted\n"
