"""The folders are the architecture: imports point one way, with no circles.

Reads every production module's imports (top level and inside functions, relative ones
resolved) and checks the rules the README's architecture section states.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("spillway", "functions", "gpu_service", "batch_job", "spillway_cli", "bench")


def _modules() -> dict[str, Path]:
    found = {}
    for top in PRODUCTION:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _known(name: str) -> str | None:
    while name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _imports(name: str, path: Path) -> Iterator[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            named = [node.module] if node.module else []
            module = ".".join([*base, *named] if node.level else named)
            targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
        else:
            continue
        for target in targets:
            known = _known(target)
            if known is not None and known != name:
                yield known


GRAPH = {name: set(_imports(name, path)) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return found


def test_the_reader_sees_the_imports_it_checks() -> None:
    # The rules below mean something only if the graph holds known edges.
    assert "spillway.router.dispatch" in GRAPH["functions.router.handler"] | {
        t for m in GRAPH["functions.router.handler"] for t in GRAPH[m]
    }
    assert "spillway.protocol.wire" in GRAPH["spillway.router.app"]
    assert "spillway.models.kinds" in GRAPH["spillway.models.engine"]


def test_no_import_circles() -> None:
    assert _cycles() == []


def test_only_the_cli_and_bench_import_the_cli() -> None:
    offenders = {
        (name, target)
        for name, targets in GRAPH.items()
        for target in targets
        if target.startswith("spillway_cli") and not name.startswith(("spillway_cli", "bench"))
    }
    assert offenders == set()


def test_nothing_outside_functions_imports_a_lambda_package() -> None:
    offenders = {
        (name, target)
        for name, targets in GRAPH.items()
        for target in targets
        if target.startswith("functions") and not name.startswith("functions")
    }
    assert offenders == set()


def test_the_core_never_imports_a_deployable() -> None:
    deployables = ("functions", "gpu_service", "batch_job", "spillway_cli", "bench")
    offenders = {
        (name, target)
        for name, targets in GRAPH.items()
        if name.startswith("spillway.")
        for target in targets
        if target.startswith(deployables)
    }
    assert offenders == set()
