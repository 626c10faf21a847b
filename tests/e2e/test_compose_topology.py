"""deploy/docker-compose.yml run as local processes: the same commands, environment and replicas.

Each compose service becomes `deploy.replicas` processes on loopback; the names the services use
for one another become loopback addresses (`dns:///decoder:50053`, which compose resolves to one
address per replica, becomes the `ipv4:` list of the decoder processes), the image's paths become
this machine's prepared models and a scratch directory, and the internal-token secret a file.
Services start in `depends_on` order and are judged healthy by the compose healthcheck command
itself. Then Generate, Embed, Rerank, an adapter and an image request all answer through the
gateway, the way they would on one Docker host.
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from services.common.launch import REPO, free_port, service_env
from services.common.server import CHANNEL_OPTIONS
from tessera.v1 import adapters_pb2, gateway_pb2_grpc, pooling_pb2
from tests.deploy.service_commands import TOKEN_FILE, localize
from tests.deploy.test_compose import compose_config

from .test_generate import chat_request, collect
from .test_images import image_request, png_bytes
from .test_lora import peft_adapter  # noqa: F401 - fixture

START_ORDER = ("adapters", "vision", "pooling", "decoder", "gateway")
_TARGET = re.compile(r"^(dns:///)?([a-z]+):(\d+)$")


class Topology:
    """The compose services as processes: `addresses[name]` lists one loopback address per replica."""

    def __init__(self, compose: dict, scratch: Path):
        self.compose, self.scratch = compose, scratch
        self.token_file = scratch / "internal-token"
        self.token_file.write_text(secrets.token_hex(32))
        self.token_file.chmod(0o600)
        self.addresses = {
            name: [f"127.0.0.1:{free_port()}" for _ in range(service.get("deploy", {}).get("replicas", 1))]
            for name, service in compose["services"].items() if name != "models"}
        self.processes: list[tuple[str, subprocess.Popen, Path]] = []

    def rewrite(self, argv: list[str]) -> list[str]:
        """A container command as this host runs it."""
        out = []
        for i, arg in enumerate(argv):
            previous = argv[i - 1] if i else ""
            match = _TARGET.match(arg)
            if arg == "python":
                arg = sys.executable
            elif previous == "--metrics-port":
                arg = str(free_port())
            elif match and match.group(2) in self.addresses:
                replicas = self.addresses[match.group(2)]
                arg = "ipv4:" + ",".join(replicas) if match.group(1) else replicas[0]
            out.append(arg)
        return localize(out, self.scratch)

    def environment(self, service: dict) -> dict[str, str]:
        env = {key: str(value) for key, value in (service.get("environment") or {}).items()}
        if env.get("TESSERA_INTERNAL_TOKEN_FILE") == TOKEN_FILE:
            env["TESSERA_INTERNAL_TOKEN_FILE"] = str(self.token_file)
        return service_env(env)

    def start(self, name: str) -> None:
        service = self.compose["services"][name]
        for index, address in enumerate(self.addresses[name]):
            argv = self.rewrite(service["command"])
            argv[argv.index("--address") + 1] = address
            log = self.scratch / f"{name}-{index}.log"
            with log.open("w") as sink:
                process = subprocess.Popen(argv, cwd=REPO, env=self.environment(service), stdout=sink,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.processes.append((f"{name}-{index}", process, log))

    def wait_healthy(self, name: str, timeout_s: float = 300.0) -> None:
        """Poll with the compose healthcheck's own command, as docker would."""
        test = self.compose["services"][name]["healthcheck"]["test"]
        assert test[0] == "CMD", test
        deadline = time.monotonic() + timeout_s
        for address in self.addresses[name]:
            command = self.rewrite(test[1:])
            command[command.index("services.common.healthcheck") + 1] = address
            while subprocess.run(command, cwd=REPO, capture_output=True).returncode != 0:
                for label, process, log in self.processes:
                    assert process.poll() is None, f"{label} exited:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"{name} at {address} not healthy after {timeout_s} s"
                time.sleep(0.5)

    def stop(self) -> None:
        for _, process, _ in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for _, process, _ in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def depends_on_order(compose: dict) -> list[str]:
    """Services sorted so each comes after what it depends on (the models job is done already)."""
    done: list[str] = []
    pending = [name for name in START_ORDER if name in compose["services"]]
    while pending:
        ready = [n for n in pending if set(compose["services"][n].get("depends_on", {})) - {"models"} <= set(done)]
        assert ready, f"depends_on has a cycle among {pending}"
        done.extend(ready)
        pending = [n for n in pending if n not in ready]
    return done


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    code, out, err = compose_config()  # anchors merged, ${VAR:-default} as docker would fill them
    assert code == 0, err
    compose = yaml.safe_load(out)
    scratch = tmp_path_factory.mktemp("compose")
    topology = Topology(compose, scratch)
    try:
        for name in depends_on_order(compose):
            paths = [arg for arg in topology.rewrite(compose["services"][name]["command"])
                     if arg.startswith(str(scratch))]
            for path in paths:  # the named volumes: the adapter root and the catalog's directory
                (Path(path) if "." not in Path(path).name else Path(path).parent).mkdir(parents=True, exist_ok=True)
            topology.start(name)
            topology.wait_healthy(name)
        yield topology
    finally:
        topology.stop()


@pytest.fixture(scope="module")
def gateway(topology):
    [address] = topology.addresses["gateway"]
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def test_compose_replicas_become_target_lists(topology):
    assert len(topology.addresses["decoder"]) == 2 and len(topology.addresses["pooling"]) == 2
    gateway_argv = topology.rewrite(topology.compose["services"]["gateway"]["command"])
    decoder_target = gateway_argv[gateway_argv.index("--decoder") + 1]
    assert decoder_target == "ipv4:" + ",".join(topology.addresses["decoder"])


def test_every_capability_answers_through_the_gateway(topology, gateway, peft_adapter, adapter_root):  # noqa: F811
    answer = collect(gateway, chat_request("What is the capital of France?", 8))
    assert answer["finish"] in ("stop", "length") and answer["ids"]

    embeddings = gateway.Embed(pooling_pb2.EmbedRequest(inputs=["a cat", "a kitten", "a truck"]), timeout=120)
    assert list(embeddings.embeddings.shape) == [3, 384]
    ranked = gateway.Rerank(pooling_pb2.RerankRequest(
        query="capital of France", documents=["Bananas are yellow.", "Paris is the capital of France."]),
        timeout=120)
    assert ranked.results[0].index == 1

    with_image = collect(gateway, image_request(png_bytes(40, 30)))
    assert with_image["finish"] in ("stop", "length") and with_image["usage"].image_tokens > 0

    root = topology.scratch / "adapters"
    shutil.copytree(adapter_root / "qv-adapter", root / "qv-adapter")
    info = gateway.LoadAdapter(adapters_pb2.LoadAdapterRequest(name="qv", path="qv-adapter"), timeout=120)
    assert info.name == "qv" and len(info.digest) == 64
    request = chat_request("What is the capital of France?", 8)
    request.lora = "qv"
    with_adapter = collect(gateway, request)
    assert with_adapter["finish"] in ("stop", "length") and with_adapter["ids"]
