"""The folders are the architecture: imports point one way, with no circles.

Reads every production module's imports (top level and inside functions, relative ones
resolved) and checks the rules the README's architecture section states: no circle
between modules, and packages in layers (``LAYERS``), each importing only the layers below
its own, with no circle between packages either. The layer list in docs/architecture.md
and the package pictures there and in the README are checked against the same graph.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest

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


def _package(module: str) -> str:
    """The package a module belongs to: ``spillway.<sub>`` in the core (a top-level module
    such as ``spillway.inference`` is its own), else the top-level folder."""
    top, _, rest = module.partition(".")
    return f"{top}.{rest.split('.')[0]}" if top == "spillway" and rest else top


def _package_graph() -> dict[str, dict[str, set[tuple[str, str]]]]:
    """Package -> the packages it imports -> the module imports that make each edge."""
    graph: dict[str, dict[str, set[tuple[str, str]]]] = {_package(m): {} for m in GRAPH}
    for name, targets in GRAPH.items():
        for target in targets:
            if _package(target) != _package(name):
                graph[_package(name)].setdefault(_package(target), set()).add((name, target))
    return graph


PACKAGE_GRAPH = _package_graph()

LAYERS: tuple[tuple[str, ...], ...] = (
    # The version, the base of every settings class, the names the Lambda handlers'
    # Powertools share, the trace context every tier carries: nothing of the project
    # below them (``spillway.powertools`` sets tracing up, so it sits beside it).
    ("spillway.tracing",),
    ("spillway", "spillway.envsettings", "spillway.powertools"),
    ("spillway.protocol",),
    # AWS access: the client factory, botocore's errors, the AWS limits table.
    ("spillway.aws",),
    ("spillway.state",),
    ("spillway.tenancy",),
    # With the blocks a model's config.json holds: pipeline schema, canary spec.
    ("spillway.models",),
    ("spillway.inference",),
    ("spillway.async_inference",),
    ("spillway.pipelines",),
    # With the backend contract the canary guard and the router share.
    ("spillway.policy",),
    # The canary's version choice, and data capture (what the router's watcher keeps).
    ("spillway.canary", "spillway.capture"),
    # The services the Lambda handlers (and ``spillway serve``) run.
    ("spillway.router", "spillway.streams", "spillway.fallback"),
    ("batch_job", "gpu_service"),
    # The jobs handler adapts ``batch_job.api``.
    ("functions",),
    ("spillway_cli",),
    ("bench",),
)
"""Packages in layers, lowest first: a package imports only packages of lower layers, so
the packages side by side in one layer never import each other."""

LAYER = {package: level for level, layer in enumerate(LAYERS) for package in layer}


DOCS = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
UNDRAWN = {"spillway", "spillway.envsettings", "spillway.powertools", "spillway.tracing", "bench"}
"""Packages the package pictures leave out: the bare foundation, and the benchmarks."""


def _documented_layers() -> list[tuple[str, ...]]:
    """The numbered list under docs/architecture.md's ``## Layers``: each item's packages."""
    section = DOCS.read_text(encoding="utf-8").split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^\d+\. (.+?) — ", section, re.MULTILINE)
    return [tuple(re.findall(r"`([a-z_.]+)`", item)) for item in items]


def _picture(path: Path) -> tuple[list[str], set[tuple[str, str]]]:
    """The packages a file's package picture (its ``flowchart TB``) draws, in the order it
    declares them, and its arrows between packages (arrows to a subgraph are skipped)."""
    text = path.read_text(encoding="utf-8")
    block = text.split("```mermaid\nflowchart TB\n", 1)[1].split("```", 1)[0]
    nodes = {
        node: leaf if leaf in PRODUCTION else f"spillway.{leaf}"
        for node, leaf in re.findall(r'^ *(\w+)\["([a-z_]+)(?:/|\.py) — ', block, re.MULTILINE)
    }
    subgraphs = set(re.findall(r"^ *subgraph (\w+)\[", block, re.MULTILINE))
    arrows: set[tuple[str, str]] = set()
    for line in block.splitlines():
        if "-->" not in line or "[" in line:
            continue
        hops = [[node.strip() for node in hop.split("&")] for hop in line.split("-->")]
        assert {node for hop in hops for node in hop} <= nodes.keys() | subgraphs, line
        for sources, targets in pairwise(hops):
            arrows |= {
                (nodes[a], nodes[b]) for a in sources for b in targets if a in nodes and b in nodes
            }
    return list(nodes.values()), arrows


def _cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    graph = GRAPH if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
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

    for node in sorted(graph):
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


def test_every_package_has_one_layer() -> None:
    # A new package is placed in the layers before it can be checked.
    listed = [package for layer in LAYERS for package in layer]
    assert len(listed) == len(set(listed))
    assert set(listed) == set(PACKAGE_GRAPH)


def test_a_package_imports_only_lower_layers() -> None:
    # Upward is a layering mistake; sideways, within a layer, joins two packages the
    # layers keep apart (the router, the streams and the CPU fallback are siblings).
    offenders = {
        (name, target)
        for package, targets in PACKAGE_GRAPH.items()
        for imported, edges in targets.items()
        if LAYER[imported] >= LAYER[package]
        for name, target in edges
    }
    assert offenders == set()


def test_no_package_circles() -> None:
    assert _cycles({package: set(targets) for package, targets in PACKAGE_GRAPH.items()}) == []


def test_the_docs_list_the_layers() -> None:
    assert _documented_layers() == list(LAYERS)


@pytest.mark.parametrize("path", [README, DOCS], ids=["README", "architecture"])
def test_the_package_picture_draws_every_layer_top_down(path: Path) -> None:
    drawn, _ = _picture(path)
    assert sorted(drawn) == sorted(set(LAYER) - UNDRAWN)
    levels = [LAYER[package] for package in drawn]
    assert levels == sorted(levels, reverse=True)


@pytest.mark.parametrize("path", [README, DOCS], ids=["README", "architecture"])
def test_the_package_picture_draws_only_imports_that_point_down(path: Path) -> None:
    _, arrows = _picture(path)
    assert ("spillway.router", "spillway.canary") in arrows  # the reader sees the arrows
    drawn_wrong = {
        (package, imported)
        for package, imported in arrows
        if imported not in PACKAGE_GRAPH[package] or LAYER[imported] >= LAYER[package]
    }
    assert drawn_wrong == set()


def test_only_the_cli_and_bench_import_the_cli() -> None:
    offenders = {
        (name, target)
        for name, targets in GRAPH.items()
        for target in targets
        if target.startswith("spillway_cli") and not name.startswith(("spillway_cli", "bench"))
    }
    assert offenders == set()


LOCAL_STAND_INS = "spillway_cli.local"
"""The local stand-ins and the local stack, below the CLI's commands: the commands start
them, they never reach up (a package of ``spillway_cli`` in the layers above)."""
LOCAL_STAND_INS_MAY_IMPORT = frozenset({"spillway_cli.statemachines"})
"""What the stand-ins may import of the CLI outside their package: the pipelines' Step
Functions definitions, which the local Step Functions runs as the templates deploy them."""


def _in_local(name: str) -> bool:
    return name == LOCAL_STAND_INS or name.startswith(f"{LOCAL_STAND_INS}.")


def test_the_local_stand_ins_never_import_the_commands() -> None:
    assert "spillway_cli.local.layout" in GRAPH["spillway_cli.local.stack"]  # edges are seen
    offenders = {
        (name, target)
        for name, targets in GRAPH.items()
        if _in_local(name)
        for target in targets
        if target.startswith("spillway_cli") and not _in_local(target)
        if target not in LOCAL_STAND_INS_MAY_IMPORT
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


AWS_SDK = ("boto3", "botocore")
AWS_SDK_ALLOWED: frozenset[str] = frozenset()
"""Production modules outside ``spillway.aws`` allowed to import boto3 or botocore
directly (none: the local stand-ins go through ``spillway.aws`` too)."""


def _sdk_imports(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        yield from (name for name in names if name.split(".")[0] in AWS_SDK)


def test_only_spillway_aws_imports_boto3_or_botocore() -> None:
    # One home for AWS access: clients, their timeouts and retries, and botocore's errors
    # are reached through ``spillway.aws`` (tests may import the SDK themselves).
    offenders = {
        (name, imported)
        for name, path in MODULES.items()
        if name != "spillway.aws" and not name.startswith("spillway.aws.")
        if name not in AWS_SDK_ALLOWED
        for imported in _sdk_imports(path)
    }
    assert offenders == set()
    assert set(_sdk_imports(MODULES["spillway.aws.clients"])) >= {"boto3", "botocore.config"}
