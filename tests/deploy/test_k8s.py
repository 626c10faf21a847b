"""deploy/k8s: the kustomize base and every overlay render with kubectl's kustomize (only with the
secrets an operator supplies), validate strictly against the Kubernetes schemas, and carry commands,
ports and mounts the services accept."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.service_commands import (
    DEPLOY,
    GRPC_SERVICE,
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

K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
KUBECTL = "/usr/bin/kubectl"
# what an operator writes before rendering (git ignores secrets/): directory -> its secret files
SECRET_FILES = {".": ("internal-token",),
                "overlays/production": ("internal-token", "admin-token", "api-keys", "tls.crt", "tls.key")}
API_KEYS_FILE = "/run/secrets/tessera-api-keys"


def kustomize(directory: Path) -> subprocess.CompletedProcess:
    assert Path(KUBECTL).exists(), (f"{KUBECTL} is missing: this machine's image ships kubectl (its built-in "
                                    "kustomize renders deploy/k8s); install kubectl to run these checks")
    return run([KUBECTL, "kustomize", str(directory)])


def render(directory: Path) -> str:
    done = kustomize(directory)
    assert done.returncode == 0, done.stderr
    return done.stdout


def copy_without_secrets(destination: Path) -> Path:
    """deploy/k8s as git holds it: without any secrets/ an operator may have written here."""
    shutil.copytree(K8S, destination, ignore=shutil.ignore_patterns("secrets"))
    return destination


def write_secrets(k8s: Path, token: str = "") -> None:
    """Every secret file, as an operator writes them: random tokens and a self-signed certificate."""
    import secrets

    from tests.test_auth import _self_signed

    for directory, names in SECRET_FILES.items():
        folder = k8s / directory / "secrets"
        folder.mkdir()
        for name in names:
            if name in ("internal-token", "admin-token", "api-keys"):
                (folder / name).write_text((token or secrets.token_hex(32)) + "\n")
        if "tls.crt" in names:
            cert, key = _self_signed(folder, ("tessera.example.com",))
            cert.rename(folder / "tls.crt")
            key.rename(folder / "tls.key")


@pytest.fixture(scope="module")
def k8s(tmp_path_factory) -> Path:
    """A copy of deploy/k8s with every secret supplied."""
    copy = copy_without_secrets(tmp_path_factory.mktemp("deploy") / "k8s")
    write_secrets(copy)
    return copy


@pytest.fixture(scope="module")
def base(k8s) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(render(k8s)) if doc]


@pytest.fixture(scope="module")
def production(k8s) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(render(k8s / "overlays" / "production")) if doc]


@pytest.fixture(scope="module")
def gpu(k8s) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(render(k8s / "overlays" / "gpu")) if doc]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_there_are_the_overlays():
    assert [p.name for p in OVERLAYS] == ["gpu", "production"]


def test_secrets_are_ignored_by_git():
    for directory, names in SECRET_FILES.items():
        for name in names:
            path = K8S / directory / "secrets" / name
            done = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=DEPLOY, timeout=30)
            assert done.returncode == 0, f"{path} is not ignored by git"


@pytest.mark.parametrize("directory", [".", *(str(p.relative_to(K8S)) for p in OVERLAYS)])
def test_nothing_renders_without_the_supplied_secrets(directory, tmp_path):
    """No placeholder to forget: without the operator's files kustomize refuses, naming the file."""
    copy = copy_without_secrets(tmp_path / "k8s")
    done = kustomize(copy / directory)
    assert done.returncode != 0, done.stdout
    assert "secrets/internal-token" in done.stderr, done.stderr


@pytest.mark.parametrize("directory", [".", *(str(p.relative_to(K8S)) for p in OVERLAYS)])
def test_renders_and_validates_strictly(directory, k8s):
    rendered = render(k8s / directory)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    done = run([tool("kubernetes-validate"), "--strict", "-"], stdin=rendered)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # a kind without a schema is only a warning (exit 0): every resource must have been checked
    assert "WARN" not in output and "could not be validated" not in output.lower(), output
    assert output.count("passed for resource") == len(docs), output


def test_overlay_changes_replicas_and_image(base, production):
    docs = production
    base_deployments, deployments = by_kind(base, "Deployment"), by_kind(docs, "Deployment")
    assert deployments["decoder"]["spec"]["replicas"] != base_deployments["decoder"]["spec"]["replicas"]
    images = {c["image"] for d in deployments.values() for c in d["spec"]["template"]["spec"]["containers"]}
    base_images = {c["image"] for d in base_deployments.values() for c in d["spec"]["template"]["spec"]["containers"]}
    assert len(images) == 1 and images != base_images
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["decoder"]["spec"]
    assert hpa["minReplicas"] == deployments["decoder"]["spec"]["replicas"]


def workloads(docs: list[dict]) -> dict[str, dict]:
    """service name -> its Deployment or StatefulSet."""
    found = {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}
    assert set(found) == set(SERVICES)
    return found


def test_kinds(base):
    assert set(by_kind(base, "Deployment")) == {"gateway", "decoder", "pooling", "vision"}
    [registry] = by_kind(base, "StatefulSet").values()
    assert registry["spec"]["replicas"] == 1
    assert {t["metadata"]["name"] for t in registry["spec"]["volumeClaimTemplates"]} == {"registry", "adapters"}
    services = by_kind(base, "Service")
    assert {n for n, s in services.items() if s["spec"].get("clusterIP") == "None"} == {"decoder", "pooling"}
    assert {n for n, s in services.items() if s["spec"].get("type") == "ClusterIP"} == {"gateway", "vision", "adapters"}
    [pdb] = by_kind(base, "PodDisruptionBudget").values()
    assert pdb["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "decoder"}
    [models_pvc] = by_kind(base, "PersistentVolumeClaim").values()
    assert "ReadOnlyMany" in models_pvc["spec"]["accessModes"]
    [job] = by_kind(base, "Job").values()
    [prepare] = job["spec"]["template"]["spec"]["containers"]
    assert prepare["command"][:2] == ["sh", "-ec"]
    assert prepare["command"][2].startswith(
        f"tessera models prepare --dir {IMAGE_MODELS} ${{DECODER_KEEP_QUANTIZED:+--quantized}};")
    [secret] = by_kind(base, "Secret").values()   # generated from secrets/internal-token, hashed name
    assert secret["metadata"]["name"].startswith("tessera-internal-token-") and set(secret["data"]) == {"token"}


def test_hpas_scale_on_queue_depth_the_services_export(base):
    hpas = by_kind(base, "HorizontalPodAutoscaler")
    want = {"decoder": "vllm_num_requests_waiting", "pooling": "tessera_pooling_queue_size"}
    assert set(hpas) == set(want)
    for name, metric in want.items():
        spec = hpas[name]["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        [source] = spec["metrics"]
        assert source["type"] == "Pods" and source["pods"]["metric"]["name"] == metric


def container(workload: dict) -> dict:
    [server] = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
    return server


def model_settings(docs: list[dict]) -> dict[str, str]:
    """The tessera-model ConfigMap's data (its name carries kustomize's hash)."""
    [config_map] = [d for n, d in by_kind(docs, "ConfigMap").items() if n.startswith("tessera-model-")]
    return config_map["data"]


def expanded(docs: list[dict], workload: dict, c: dict) -> list[str]:
    """`c`'s command with `$(NAME)` replaced as the kubelet does, from its `env` and its `envFrom`
    ConfigMaps (every name it uses must be defined there)."""
    config_maps = by_kind(docs, "ConfigMap")
    env = {}
    for source in c.get("envFrom", []):
        env |= config_maps[source["configMapRef"]["name"]]["data"]
    env |= {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    used = {n for arg in c["command"] for n in re.findall(r"\$\((\w+)\)", arg)}
    assert used <= set(env), f"{workload['metadata']['name']} uses undefined {used - set(env)}"
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], arg) for arg in c["command"]]


def test_commands_ports_probes_and_mounts(base, tmp_path):
    found = workloads(base)
    services = by_kind(base, "Service")
    ports = {}
    for name, workload in found.items():
        pod, server = workload["spec"]["template"], container(workload)
        server = {**server, "command": expanded(base, workload, server)}
        parsed, address, config = parse_command(server["command"], tmp_path)
        assert parsed == name
        host, port = host_port(address)
        ports[name] = port
        assert host == "0.0.0.0"
        container_ports = {p["name"]: p["containerPort"] for p in server["ports"]}
        assert container_ports["grpc"] == port
        assert services[name]["spec"]["ports"][0]["port"] == port
        assert services[name]["spec"]["selector"] == workload["spec"]["selector"]["matchLabels"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert server[probe]["grpc"] == {"port": port, "service": GRPC_SERVICE[name]}, (name, probe)
        if name in ("decoder", "pooling", "vision"):  # model loading must fit the startup probe's patience
            startup = server["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, name
        metrics_port = getattr(config, "metrics_port", 0)
        annotations = pod["metadata"].get("annotations", {})
        if metrics_port:
            assert container_ports["metrics"] == metrics_port
            assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port),
                                   "prometheus.io/path": "/metrics"}
        assert set(server["resources"]) == {"requests", "limits"}
        env = {e["name"]: e.get("value") for e in server["env"]}
        assert env["TESSERA_INTERNAL_TOKEN_FILE"] == TOKEN_FILE
        check_mounts(name, workload, server)
    gateway = container(found["gateway"])["command"]
    assert flag_values(gateway, "--decoder") == [f"dns:///decoder:{ports['decoder']}"]
    assert flag_values(gateway, "--pooling") == [f"dns:///pooling:{ports['pooling']}"]
    for flag, target in (("--adapters", "adapters"), ("--vision", "vision")):
        assert [host_port(t) for t in flag_values(gateway, flag)] == [(target, ports[target])]


def check_mounts(name: str, workload: dict, server: dict) -> None:
    pod_spec = workload["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    for flag in PATH_FLAGS:
        for path in flag_values(server["command"], flag):
            [target] = [t for t in mounts if path == t or path.startswith(t + "/")] or [None]
            assert target, f"{name} {flag} {path} is on no volume"
            assert mounts[target]["name"] in volumes or mounts[target]["name"] in claims
    assert mounts[IMAGE_MODELS]["readOnly"] is True
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "tessera-models", "readOnly": True}
    # the one file (as compose mounts it), not a directory over /run/secrets hiding what else mounts there
    assert mounts[TOKEN_FILE]["subPath"] == Path(TOKEN_FILE).name and str(Path(TOKEN_FILE).parent) not in mounts
    assert pod_spec["automountServiceAccountToken"] is False  # tessera never calls the Kubernetes API
    token = volumes[mounts[TOKEN_FILE]["name"]]["secret"]
    assert token["secretName"].startswith("tessera-internal-token-")   # the generated one, by its hashed name
    assert token["items"] == [{"key": "token", "path": Path(TOKEN_FILE).name}]
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert server["securityContext"]["readOnlyRootFilesystem"] is True and "/tmp" in mounts


def test_readme_configuration_lists_every_setting(base):
    """Every flag and environment variable the deploy files set has its row in README's table."""
    readme = (DEPLOY.parent / "README.md").read_text()
    table = readme.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    compose_text = (DEPLOY / "docker-compose.yml").read_text()
    compose = yaml.safe_load(compose_text)
    commands = [s["command"] for s in compose["services"].values()]
    names = {v for s in compose["services"].values() for v in (s.get("environment") or {})}
    names |= set(re.findall(r"\$\{(\w+)", compose_text))   # the compose file's own variables
    for workload in [*by_kind(base, "Deployment").values(), *by_kind(base, "StatefulSet").values(),
                     *by_kind(base, "Job").values()]:
        for c in workload["spec"]["template"]["spec"]["containers"]:
            commands.append(c["command"])
            names |= {e["name"] for e in c.get("env", [])}
    flags = {arg for command in commands for arg in command if arg.startswith("--")}
    assert flags and names
    missing = [s for s in sorted(flags | names) if not re.search(rf"`[^`]*(?<![\w-]){re.escape(s)}(?![\w-])[^`]*`", table)]
    assert not missing, f"README's Configuration table lacks {missing}"


def secret_named(docs: list[dict], prefix: str) -> dict:
    [secret] = [d for n, d in by_kind(docs, "Secret").items() if n.startswith(prefix + "-")]
    return secret


def test_production_wires_every_secret(production):
    """The internal token, the admin token (required, not optional), the API keys (the gateway's
    --api-key-file) and the TLS certificate (the Ingress's), each generated from its file."""
    found = workloads(production)
    token = secret_named(production, "tessera-internal-token")["metadata"]["name"]
    for workload in found.values():
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert any(v.get("secret", {}).get("secretName") == token for v in volumes.values())
    admin = secret_named(production, "tessera-admin-token")["metadata"]["name"]
    [ref] = [e["valueFrom"]["secretKeyRef"] for e in container(found["adapters"])["env"]
             if e["name"] == "TESSERA_ADMIN_TOKEN"]
    assert ref == {"name": admin, "key": "token", "optional": False}
    gateway = container(found["gateway"])
    assert {e["name"]: e.get("value") for e in gateway["env"]}["TESSERA_API_KEY_FILE"] == API_KEYS_FILE
    [mount] = [m for m in gateway["volumeMounts"] if m["mountPath"] == API_KEYS_FILE]
    volumes = {v["name"]: v for v in found["gateway"]["spec"]["template"]["spec"]["volumes"]}
    keys = volumes[mount["name"]]["secret"]
    assert keys["secretName"] == secret_named(production, "tessera-api-keys")["metadata"]["name"]
    assert keys["items"] == [{"key": "api-keys", "path": mount["subPath"]}]
    tls = secret_named(production, "tessera-tls")
    assert tls["type"] == "kubernetes.io/tls" and set(tls["data"]) == {"tls.crt", "tls.key"}
    [ingress] = by_kind(production, "Ingress").values()
    assert [t["secretName"] for t in ingress["spec"]["tls"]] == [tls["metadata"]["name"]]
    [rule] = ingress["spec"]["rules"]
    [path] = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": "gateway", "port": {"name": "http"}}


def test_a_placeholder_secret_renders_but_no_service_starts_with_it(tmp_path):
    """kustomize cannot judge a file's content; the services refuse the well-known placeholders."""
    import base64

    from services.common.auth import refuse_placeholder

    copy = copy_without_secrets(tmp_path / "k8s")
    write_secrets(copy, token="replace-me-in-an-overlay")
    docs = [d for d in yaml.safe_load_all(render(copy / "overlays" / "production")) if d]
    for name in ("tessera-internal-token", "tessera-admin-token"):
        value = base64.b64decode(secret_named(docs, name)["data"]["token"]).decode()
        with pytest.raises((SystemExit, ValueError), match="placeholder"):
            refuse_placeholder(name, value)


def test_the_model_is_a_parameter(k8s, tmp_path):
    """One ConfigMap names the models: an overlay that merges its own changes every command, the
    init containers' wait and the models Job's import, and the commands still parse."""
    overlay = k8s / "overlays" / "production"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(overlay, mine)],   # kustomize takes only relative ones
        "configMapGenerator": [{"name": "tessera-model", "behavior": "merge", "literals": [
            "DECODER_MODEL=my-model", "DECODER_SERVED_NAME=Org/My-Model",
            "DECODER_SOURCE=/var/lib/tessera/import/my-model-q8_0.gguf", "QUANT_MODE=fast"]}]}))
    docs = [d for d in yaml.safe_load_all(render(mine)) if d]
    settings = model_settings(docs)
    assert settings["DECODER_MODEL"] == "my-model" and settings["EMBEDDING_MODEL"] == "all-minilm-l6-v2"
    found = workloads(docs)
    decoder = expanded(docs, found["decoder"], container(found["decoder"]))
    assert flag_values(decoder, "--model-dir") == [f"{IMAGE_MODELS}/my-model"]
    assert decoder[decoder.index("--served-model-name") + 1:] == ["Org/My-Model", "my-model"]
    assert flag_values(decoder, "--quant-mode") == ["fast"]
    assert flag_values(expanded(docs, found["vision"], container(found["vision"])),
                       "--decoder-model-dir") == [f"{IMAGE_MODELS}/my-model"]
    assert flag_values(expanded(docs, found["adapters"], container(found["adapters"])),
                       "--base-model-dir") == [f"{IMAGE_MODELS}/my-model"]
    [job] = by_kind(docs, "Job").values()
    pod = job["spec"]["template"]["spec"]
    [prepare] = pod["containers"]
    assert 'tessera models import "$DECODER_SOURCE" --name "$DECODER_MODEL"' in prepare["command"][2]
    assert "${DECODER_KEEP_QUANTIZED:+--keep-quantized}; fi" in prepare["command"][2]
    assert {m["mountPath"]: m.get("readOnly") for m in prepare["volumeMounts"]}["/var/lib/tessera/import"] is True
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims["model-source"] == "tessera-model-source" and "tessera-model-source" in by_kind(
        docs, "PersistentVolumeClaim")
    for workload in found.values():   # everything reads the one ConfigMap (its hashed name)
        pod = workload["spec"]["template"]["spec"]
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            names = [s["configMapRef"]["name"] for s in c.get("envFrom", [])]
            assert [n for n in names if n.startswith("tessera-model-")], (workload["metadata"]["name"], c["name"])


def test_the_kv_cache_is_sized_from_a_memory_budget(base, tmp_path):
    found = workloads(base)
    command = expanded(base, found["decoder"], container(found["decoder"]))
    _, _, config = parse_command(command, tmp_path)
    assert config.kv_cache_memory_bytes == 2**30 and config.num_blocks > 0


def test_the_gpu_overlay_puts_the_decoders_on_gpus(gpu, production):
    found, cpu = workloads(gpu), workloads(production)
    decoder = found["decoder"]["spec"]["template"]["spec"]
    server = container(found["decoder"])
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert decoder["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in decoder["tolerations"]
    assert {e["name"]: e.get("value") for e in server["env"]}["TESSERA_DECODER_DEVICE"] == "cuda"
    assert server["image"].endswith("-cuda")
    assert flag_values(server["command"], "--kv-cache-memory-bytes")[-1] == "8GiB"   # the last one wins
    for name in set(SERVICES) - {"decoder"}:   # the rest stays on the CPU, as production has it
        assert container(found[name]) == container(cpu[name]), name
        assert "nvidia.com/gpu" not in container(found[name])["resources"]["limits"]
