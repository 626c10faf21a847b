"""The import graph of the repository's two packages (the generated tessera.v1 stubs aside), read from the
source (ast): `tessera` (client, CLI, stubs: the light distribution) and `services` (the server side).
No cycle; no service importing another (services.common and the stubs are shared); services import
nothing from tessera.cli; the client imports nothing from services; the decoder's engine free of gRPC
and generated stubs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("adapters", "decoder", "gateway", "pooling", "vision")
PACKAGES = ("tessera", "services")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, modules: frozenset[str] = frozenset()) -> set[str]:
    """Every module `path` imports, at the top or inside a function, as absolute names: `from x import y`
    counts x.y when that is one of `modules` (a submodule), else x."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return names


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")
             if "v1" not in p.relative_to(REPO).parts and p.name != "setup.py"}
    modules = frozenset(paths)
    return {name: {i for i in _imports(path, name, modules) if i in modules} for name, path in paths.items()}


GRAPH = _graph()


def _service_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 1 and parts[1] in SERVICES else None


def test_the_graph_is_read():
    assert {"services.decoder.engine", "services.decoder.engine_core"} <= set(GRAPH)
    assert "services.decoder.engine_core" in GRAPH["services.decoder.engine"]
    assert "services.common.errors" in GRAPH["services.common.error_interceptor"]
    assert "tessera.client.sync" in GRAPH and "tessera.cli.up" in GRAPH


def test_the_layout_is_the_designs():
    """services/<name>/ for each service and common; tessera/ holds only the client, the CLI and the stubs."""
    assert all((REPO / "services" / name / "__init__.py").is_file() for name in (*SERVICES, "common"))
    assert all((REPO / "services" / name / "__main__.py").is_file() for name in SERVICES)
    packages = {p.name for p in (REPO / "tessera").iterdir() if (p / "__init__.py").is_file()}
    assert packages == {"cli", "client", "v1"}


HTTP_FAMILIES = ("chat", "pooling", "tokenize", "models", "tei")


def test_http_routes_are_split_by_family():
    """Each family of the gateway's HTTP routes is one package of router / protocol / serving (as
    vLLM's entrypoints); a family's protocol imports no other family's serving or router, and only
    app.py gathers the routers."""
    http = REPO / "services" / "gateway" / "http"
    for family in HTTP_FAMILIES:
        assert {"router.py", "protocol.py", "serving.py"} <= {p.name for p in (http / family).iterdir()}, family
        protocol = GRAPH[f"services.gateway.http.{family}.protocol"]
        assert not {m for m in protocol if m.endswith((".serving", ".router"))}, (family, protocol)
    gatherers = {m for m, imports in GRAPH.items() for i in imports if i.endswith(".router")
                 and i.startswith("services.gateway.http.")}
    assert gatherers == {"services.gateway.http.app"}


def test_no_import_cycle():
    """Depth-first search; a back edge is a cycle, reported as the loop of module names."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
    assert cycles == [], "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_service_imports_another_service():
    crossings = [(module, target) for module, targets in GRAPH.items() for target in targets
                 if _service_of(module) and _service_of(target) and _service_of(module) != _service_of(target)]
    assert crossings == [], "\n".join(f"{m} imports {t}" for m, t in crossings)


def test_services_import_nothing_from_the_cli():
    assert [(m, t) for m, ts in GRAPH.items() if m.startswith("services") for t in ts if t.startswith("tessera.cli")] == []


def test_the_client_imports_nothing_from_services():
    """tessera.client (and the modules it reaches) is the light distribution: no `services` module."""
    reached, stack = set(), ["tessera.client"]
    while stack:
        module = stack.pop()
        if module not in reached:
            reached.add(module)
            stack.extend(GRAPH[module])
    assert sorted(m for m in reached if m.startswith("services")) == []


def test_common_imports_no_service():
    assert [(m, t) for m, ts in GRAPH.items() if m.startswith("services.common") for t in ts if _service_of(t)] == []


def _path_of(module: str) -> Path:
    path = REPO.joinpath(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


@pytest.mark.parametrize("engine", ["services.decoder.engine_core", "services.decoder.engine"])
@pytest.mark.parametrize("forbidden", ["grpc", "tessera.v1"])
def test_the_decoder_engine_knows_no_transport(engine, forbidden):
    """Neither the engine core, nor its async client, nor a decoder module they reach imports
    `forbidden` (common's shared modules, the error table among them, are outside the engine's
    transport)."""
    reached, stack = set(), [engine]
    while stack:
        module = stack.pop()
        if module not in reached:
            reached.add(module)
            stack.extend(t for t in GRAPH[module] if t.startswith("services.decoder."))
    offenders = sorted(module for module in reached
                       for name in _imports(_path_of(module), module)
                       if name == forbidden or name.startswith(forbidden + "."))
    assert offenders == []


def test_the_decoder_engine_core_has_no_asyncio_side():
    """The thread loop knows no event loop: admission and streams are the async client's (engine.py)."""
    assert "asyncio" not in _imports(_path_of("services.decoder.engine_core"), "services.decoder.engine_core")
