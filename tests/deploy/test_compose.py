"""deploy/docker-compose.yml: valid for docker-compose and the compose-spec schema, and every
command, port, volume and setting is one the services accept."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.service_commands import (
    DEPLOY,
    GRPC_SERVICE,
    IMAGE_HOME,
    IMAGE_MODELS,
    PATH_FLAGS,
    SERVICES,
    TOKEN_FILE,
    flag_values,
    host_port,
    parse_command,
    run,
    tool,
)

COMPOSE = DEPLOY / "docker-compose.yml"
GPU = DEPLOY / "docker-compose.gpu.yml"
API_KEYS_FILE = "/run/secrets/tessera-api-keys"


def compose_config(path: Path = COMPOSE, *more: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    # the deploy file's own defaults, whatever this shell exports, then `env`
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | (env or {})
    files = [arg for file in (path, *more) for arg in ("-f", str(file))]
    done = subprocess.run([tool("docker-compose"), *files, "config"], capture_output=True, text=True,
                          timeout=60, env=environ)
    return done.returncode, done.stdout, done.stderr


def models_steps(service: dict, keep_quantized: str = "") -> list[list[str]]:
    """The models service's `sh -ec` script as its commands (split at `;`, shell words; `config` keeps
    the file's `$$` escapes), with `${DECODER_KEEP_QUANTIZED:+word}` expanded as sh would for that value."""
    assert service["command"][:2] == ["sh", "-ec"], service["command"]
    script = re.sub(r"\$\{DECODER_KEEP_QUANTIZED:\+([^}]*)\}", lambda m: m.group(1) if keep_quantized else "",
                    service["command"][2].replace("$$", "$"))
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";")
    lexer.whitespace_split = True
    steps, step = [], []
    for word in lexer:
        if word == ";":
            steps.append(step)
            step = []
        else:
            step.append(word)
    return [s for s in [*steps, step] if s]


@pytest.fixture(scope="module")
def compose() -> dict:
    """The file as docker-compose resolves it (anchors merged, defaults interpolated)."""
    code, out, err = compose_config()
    assert code == 0, err
    return yaml.safe_load(out)


def test_docker_compose_config_accepts_it(compose):
    assert set(compose["services"]) == {*SERVICES, "models"}


def test_docker_compose_config_refuses_mistakes(compose, tmp_path):
    """The `compose` fixture is the check itself (config exits 0); this shows the check has teeth."""
    text = COMPOSE.read_text()
    typo = tmp_path / "typo.yml"
    typo.write_text(text.replace('    restart: "no"\n', '    restart: "no"\n    restrat: always\n', 1))
    code, _, err = compose_config(typo)
    assert code != 0 and "restrat" in err
    undefined = tmp_path / "undefined.yml"
    undefined.write_text(text.replace("adapters: {condition: service_healthy}", "adaptors: {condition: service_healthy}", 1))
    code, _, err = compose_config(undefined)
    assert code != 0 and "adaptors" in err


def test_compose_spec_schema():
    done = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)])
    assert done.returncode == 0, done.stdout + done.stderr


def test_topology(compose):
    services = compose["services"]
    assert set(services) == {*SERVICES, "models"}
    assert [name for name, s in services.items() if s.get("ports")] == ["gateway"]
    published = {(p if isinstance(p, str) else f"{p['host_ip']}:{p['published']}:{p['target']}").removesuffix("/tcp")
                 for p in services["gateway"]["ports"]}  # short or long syntax
    # gRPC and HTTP, on loopback unless TESSERA_GATEWAY_HOST
    assert published == {"127.0.0.1:50051:50051", "127.0.0.1:8000:8000"}
    assert services["decoder"]["deploy"]["replicas"] == 2 and services["pooling"]["deploy"]["replicas"] == 2
    for name in SERVICES:
        service = services[name]
        assert service["restart"] == "unless-stopped"
        assert service["environment"]["TESSERA_INTERNAL_TOKEN_FILE"] == TOKEN_FILE
        # compose restarts on exit only: a service NOT_SERVING this long exits (services/common/server.py)
        assert service["environment"]["TESSERA_EXIT_UNHEALTHY_AFTER_S"] == "30"
        secrets = [s["source"] if isinstance(s, dict) else s for s in service["secrets"]]
        # the gateway also mounts its API keys (an empty stand-in while they are off)
        assert secrets == [Path(TOKEN_FILE).name, *(["tessera-api-keys"] if name == "gateway" else [])], name
        assert "egress" not in service["networks"], f"{name} must not reach outside networks"
        for dependency, condition in service["depends_on"].items():
            want = "service_completed_successfully" if dependency == "models" else "service_healthy"
            assert condition == {"condition": want}, (name, dependency)
    assert compose["networks"]["backend"]["internal"] is True
    assert services["models"]["restart"] == "no" and "healthcheck" not in services["models"]
    assert set(services["gateway"]["depends_on"]) == {"adapters", "vision", "decoder", "pooling"}


def mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """container path -> (volume, read-only)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":") if isinstance(volume, str) else (
            volume["source"], volume["target"], "ro" if volume.get("read_only") else "rw")
        out[target] = (source, mode == ["ro"])
    return out


def test_commands_parse_with_each_services_own_parser(compose, tmp_path):
    services = compose["services"]
    addresses = {}
    for name in SERVICES:
        service = services[name]
        parsed, address, config = parse_command(service["command"], tmp_path)
        assert parsed == name
        host, port = host_port(address)
        addresses[name] = port
        assert host == "0.0.0.0", f"{name} must listen on the container's interfaces"
        # the healthcheck asks this very port, for this service's name
        assert service["healthcheck"]["test"] == ["CMD", "python", "-m", "services.common.healthcheck",
                                                  f"127.0.0.1:{port}", GRPC_SERVICE[name]]
        exposed = {int(p) for p in service["expose"]}
        extra = {getattr(config, "metrics_port", 0), getattr(config, "http_port", 0)} - {0}
        assert exposed == {port} | extra, name
    assert {n: services[n]["deploy"]["replicas"] for n in ("decoder", "pooling")} == {"decoder": 2, "pooling": 2}
    assert parse_command(services["decoder"]["command"], tmp_path)[2].metrics_port == 9090
    # every address a service dials is another service's name and listening port
    gateway = services["gateway"]["command"]
    for flag, target_service in (("--decoder", "decoder"), ("--pooling", "pooling"), ("--adapters", "adapters"),
                                 ("--vision", "vision")):
        [target] = flag_values(gateway, flag)
        assert host_port(target) == (target_service, addresses[target_service]), target
    assert flag_values(gateway, "--decoder") == ["dns:///decoder:50053"]   # every replica, not one VIP
    assert flag_values(gateway, "--pooling") == ["dns:///pooling:50054"]
    [registry] = flag_values(services["decoder"]["command"], "--adapters-address")
    assert host_port(registry) == ("adapters", addresses["adapters"])


@pytest.mark.parametrize("name", [*SERVICES, "models"])
def test_paths_in_commands_lie_on_volumes(compose, name):
    service = compose["services"][name]
    mounted = mounts(service)
    command = service["command"] if name != "models" else [w for step in models_steps(service) for w in step]
    for flag in PATH_FLAGS:
        for path in flag_values(command, flag):
            [target] = [t for t in mounted if path == t or path.startswith(t + "/")] or [None]
            assert target, f"{name} {flag} {path} is on no volume (mounts: {sorted(mounted)})"
            assert path.startswith(IMAGE_HOME)
    if name == "models":
        assert mounted[IMAGE_MODELS] == ("models", False) and set(flag_values(command, "--dir")) == {IMAGE_MODELS}
    elif IMAGE_MODELS in mounted:
        assert mounted[IMAGE_MODELS] == ("models", True), f"{name} must mount the models read-only"
    if name == "adapters":
        [root], [db] = flag_values(command, "--root"), flag_values(command, "--db")
        assert mounted[root][0] == "adapters" and mounted[str(Path(db).parent)][0] == "registry"
        assert set(compose["volumes"]) >= {"models", "adapters", "registry"}


def test_dockerfile_matches_pyproject_and_the_deploy_paths():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    pyproject = (DEPLOY.parent / "services" / "pyproject.toml").read_text()  # the server distribution pins torch
    [torch_pin] = re.findall(r'"torch==([^"]+)"', pyproject)
    assert f"ARG TORCH_VERSION={torch_pin}\n" in dockerfile
    # CPU by default; the GPU image swaps both (docs/deployment.md "GPU")
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu\n" in dockerfile
    assert '--index-url "${TORCH_INDEX_URL}"' in dockerfile
    assert "ARG BASE_IMAGE=python:3.11-slim-bookworm\nFROM ${BASE_IMAGE}\n" in dockerfile
    assert f"TESSERA_HOME={IMAGE_HOME}" in dockerfile
    assert "HF_HUB_OFFLINE=1" in dockerfile and "TRANSFORMERS_OFFLINE=1" in dockerfile
    [user] = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert not user.startswith(("root", "0")), user


def test_the_models_job_prepares_then_imports_the_named_source(compose):
    """The built-in models, then (DECODER_SOURCE set, DECODER_MODEL not yet complete) `tessera models
    import`; both parse with tessera's own CLI parser."""
    from tessera.cli.main import build_parser

    service = compose["services"]["models"]
    for keep in ("", "1"):  # TESSERA_DECODER_KEEP_QUANTIZED: the Q4_1 built-in too, GGUF blocks kept
        prepare, condition, imp, end = models_steps(service, keep)
        assert build_parser().parse_args(prepare[1:]).dir == IMAGE_MODELS
        assert build_parser().parse_args(prepare[1:]).quantized is bool(keep)
        assert condition[:2] == ["if", "["] and "$DECODER_SOURCE" in condition
        assert imp[:2] == ["then", "tessera"] and end == ["fi"]
        args = build_parser().parse_args(imp[2:])
        assert (args.name, args.dir, args.keep_quantized) == ("$DECODER_MODEL", IMAGE_MODELS, bool(keep))
    assert service["environment"] == {"DECODER_MODEL": "smollm2-135m-instruct", "DECODER_SOURCE": "",
                                      "DECODER_KEEP_QUANTIZED": ""}
    assert mounts(service)["/var/lib/tessera/import"][1] is True   # the operator's checkpoints, read-only


def test_the_model_is_a_parameter(tmp_path):
    """TESSERA_DECODER_MODEL / TESSERA_SERVED_MODEL_NAME / TESSERA_DECODER_SOURCE reach every command
    that names the model, and the models job."""
    env = {"TESSERA_DECODER_MODEL": "my-model", "TESSERA_SERVED_MODEL_NAME": "Org/My-Model",
           "TESSERA_DECODER_SOURCE": "/var/lib/tessera/import/my-model-q8_0.gguf",
           "TESSERA_MODEL_SOURCE_DIR": str(tmp_path), "TESSERA_KV_CACHE_MEMORY_BYTES": "3GiB",
           "TESSERA_DECODER_KEEP_QUANTIZED": "1", "TESSERA_QUANT_MODE": "fast"}
    code, out, err = compose_config(env=env)
    assert code == 0, err
    services = yaml.safe_load(out)["services"]
    decoder = services["decoder"]["command"]
    assert flag_values(decoder, "--model-dir") == [f"{IMAGE_MODELS}/my-model"]
    assert decoder[decoder.index("--served-model-name") + 1:] == ["Org/My-Model", "my-model"]
    assert flag_values(decoder, "--kv-cache-memory-bytes") == ["3GiB"]
    assert flag_values(decoder, "--quant-mode") == ["fast"]
    assert flag_values(services["vision"]["command"], "--decoder-model-dir") == [f"{IMAGE_MODELS}/my-model"]
    assert flag_values(services["adapters"]["command"], "--base-model-dir") == [f"{IMAGE_MODELS}/my-model"]
    assert services["models"]["environment"] == {"DECODER_MODEL": "my-model", "DECODER_SOURCE": env["TESSERA_DECODER_SOURCE"],
                                                 "DECODER_KEEP_QUANTIZED": "1"}
    assert mounts(services["models"])["/var/lib/tessera/import"] == (str(tmp_path), True)


def test_the_kv_cache_is_sized_from_a_memory_budget(compose, tmp_path):
    _, _, config = parse_command(compose["services"]["decoder"]["command"], tmp_path)
    assert config.kv_cache_memory_bytes == 2**30 and config.num_blocks > 0   # derived from the budget


def test_api_keys_are_wired_to_the_gateway(compose, tmp_path):
    assert compose["services"]["gateway"]["environment"]["TESSERA_API_KEY_FILE"] == ""   # off by default
    assert compose["secrets"]["tessera-api-keys"]["file"] == "/dev/null"
    keys = tmp_path / "api-keys"
    keys.write_text("k-0123456789abcdef\n")
    code, out, err = compose_config(env={"TESSERA_API_KEYS_PATH": str(keys), "TESSERA_API_KEY_FILE": API_KEYS_FILE})
    assert code == 0, err
    on = yaml.safe_load(out)
    assert on["services"]["gateway"]["environment"]["TESSERA_API_KEY_FILE"] == API_KEYS_FILE
    assert on["secrets"]["tessera-api-keys"]["file"] == str(keys)
    # mounted where the gateway reads it
    assert {"source": Path(API_KEYS_FILE).name} in on["services"]["gateway"]["secrets"]


@pytest.fixture(scope="module")
def gpu_config() -> str:
    code, out, err = compose_config(COMPOSE, GPU)
    assert code == 0, err
    return out


def test_the_gpu_variant_validates(gpu_config, tmp_path):
    """docker-compose accepts the GPU file over the base one, and what it resolves to is valid for
    the compose-spec schema."""
    resolved = tmp_path / "resolved.yml"
    resolved.write_text(gpu_config)
    for path in (resolved, GPU):
        done = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)])
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_gpu_variant_puts_the_decoders_on_gpus(gpu_config, compose, tmp_path):
    services = yaml.safe_load(gpu_config)["services"]
    decoder = services["decoder"]
    [device] = decoder["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and int(device["count"]) == 1
    assert decoder["environment"]["TESSERA_DECODER_DEVICE"] == "cuda"
    assert decoder["image"].endswith("-cuda") and decoder["deploy"]["replicas"] == 2
    assert decoder["command"] == compose["services"]["decoder"]["command"]
    for name in set(SERVICES) - {"decoder"}:   # the rest stays as it was
        for key in ("image", "command", "environment", "deploy"):
            assert services[name].get(key) == compose["services"][name].get(key), (name, key)
