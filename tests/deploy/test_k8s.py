"""deploy/k8s: the kustomize base and every overlay render with kubectl's kustomize, validate
strictly against the Kubernetes schemas, and carry commands, ports and mounts the services accept."""

from __future__ import annotations

import re
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


def render(directory: Path) -> str:
    assert Path(KUBECTL).exists(), (f"{KUBECTL} is missing: this machine's image ships kubectl (its built-in "
                                    "kustomize renders deploy/k8s); install kubectl to run these checks")
    done = run([KUBECTL, "kustomize", str(directory)])
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(render(K8S)) if doc]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_there_is_an_overlay():
    assert [p.name for p in OVERLAYS] == ["production"]


@pytest.mark.parametrize("directory", [K8S, *OVERLAYS], ids=lambda p: str(p.relative_to(DEPLOY)))
def test_renders_and_validates_strictly(directory):
    rendered = render(directory)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    done = run([tool("kubernetes-validate"), "--strict", "-"], stdin=rendered)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # a kind without a schema is only a warning (exit 0): every resource must have been checked
    assert "WARN" not in output and "could not be validated" not in output.lower(), output
    assert output.count("passed for resource") == len(docs), output


def test_overlay_changes_replicas_and_image(base):
    [overlay] = OVERLAYS
    docs = [d for d in yaml.safe_load_all(render(overlay)) if d]
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
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "tessera", "models", "prepare", "--dir", IMAGE_MODELS]
    [secret] = by_kind(base, "Secret").values()
    assert "token" in secret["stringData"]


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


def test_commands_ports_probes_and_mounts(base, tmp_path):
    found = workloads(base)
    services = by_kind(base, "Service")
    ports = {}
    for name, workload in found.items():
        pod, server = workload["spec"]["template"], container(workload)
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
    assert token["secretName"] == "tessera-internal-token"
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
