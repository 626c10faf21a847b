"""The import graph of the tessera package (the generated tessera.v1 stubs aside), read from the source (ast): no cycle, no service importing another
service (common and the generated tessera.v1 stubs are shared; cli is the command line over them
all), and the decoder's engine free of gRPC and generated stubs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("adapters", "decoder", "gateway", "pooling", "vision")


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
    paths = {_module_name(p): p for p in (REPO / "tessera").rglob("*.py") if "v1" not in p.relative_to(REPO).parts}
    modules = frozenset(paths)
    return {name: {i for i in _imports(path, name, modules) if i in modules} for name, path in paths.items()}


GRAPH = _graph()


def _service_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SERVICES else None


def test_the_graph_is_read():
    assert "tessera.decoder.engine" in GRAPH
    assert "tessera.common.errors" in GRAPH["tessera.common.server"]


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


def test_common_imports_no_service():
    assert [(m, t) for m, ts in GRAPH.items() if m.startswith("tessera.common") for t in ts if _service_of(t)] == []


def _path_of(module: str) -> Path:
    path = REPO.joinpath(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


@pytest.mark.parametrize("forbidden", ["grpc", "tessera.v1"])
def test_the_decoder_engine_knows_no_transport(forbidden):
    """Neither the engine nor a decoder module it reaches imports `forbidden` (common's shared
    modules, the error table among them, are outside the engine's transport)."""
    reached, stack = set(), ["tessera.decoder.engine"]
    while stack:
        module = stack.pop()
        if module not in reached:
            reached.add(module)
            stack.extend(t for t in GRAPH[module] if t.startswith("tessera.decoder."))
    offenders = sorted(module for module in reached
                       for name in _imports(_path_of(module), module)
                       if name == forbidden or name.startswith(forbidden + "."))
    assert offenders == []
