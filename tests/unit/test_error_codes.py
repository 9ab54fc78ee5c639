"""One error module, one status per code: every error class a client can see is declared in
``spillway/protocol/errors.py``, and a stable code means the same HTTP status wherever it
is raised (two classes sharing a code must agree on its status).

Reads the production source with ``ast`` (as ``test_readme``'s ``_codes`` does), so the
answer does not depend on which modules a test run imported: every class, its bases
resolved through its module's own imports, and the ``code`` and ``status`` it declares
or inherits. An error class is one that derives from ``SpillwayError``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from spillway.protocol import errors

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("spillway", "batch_job", "gpu_service", "functions")
HOME = "spillway/protocol/errors.py"
BASE = (HOME, "SpillwayError")

NOT_YET_MOVED = frozenset(
    {
        # The backend contract's attempt failures (spillway/router/backends.py, which the
        # package-layering work is moving into spillway/policy): they name a ``kind``
        # for the router's attempt records, no code or status.
        "BackendError",
        "ConnectFailed",
        "TimedOut",
        "ConnectionLost",
        "CannotServe",
        # spillway/policy/rules.py: the ValueError a policy file that cannot be used
        # fails with (the CLI and the policy store report it), no code or status.
        "PolicyError",
    }
)
"""Exceptions allowed to carry a code outside errors.py until they move, by name (their
modules are being moved). None declares a code today, so none is exempted yet: one that
gains a code before its move is allowed where it is, and joins errors.py with the move.
A name no longer declared outside errors.py fails ``test_the_allow_list_is_current``:
drop it then."""


@dataclass(frozen=True)
class ErrorClass:
    """An error class as the source declares it: where, its name, its code and status."""

    path: str
    name: str
    code: str | None
    status: int | None


Key = tuple[str, str]
"""A class: its module's path (relative to the root) and its name."""


@dataclass
class _Module:
    path: str
    classes: dict[str, ast.ClassDef]
    names: dict[str, tuple[str, str]]
    """A name the module imports -> the dotted module and the name there."""
    modules: dict[str, str]
    """An ``import a.b as c`` alias -> the dotted module."""


def _dotted(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module(path: Path, root: Path) -> _Module:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    dotted = _dotted(path, root)
    package = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    names: dict[str, tuple[str, str]] = {}
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            named = [node.module] if node.module else []
            source = ".".join([*base, *named] if node.level else named)
            for alias in node.names:
                names[alias.asname or alias.name] = (source, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                modules[alias.asname or alias.name] = alias.name
    return _Module(str(path.relative_to(root)), classes, names, modules)


def _own(node: ast.ClassDef, field: str) -> object:
    """The literal a class body assigns to ``field`` (``code = "x"``, ``status: int = 4``)."""
    for statement in node.body:
        if isinstance(statement, ast.Assign):
            targets = statement.targets
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets = [statement.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == field for t in targets):
            value = statement.value
            return value.value if isinstance(value, ast.Constant) else None
    return None


def error_classes(root: Path = ROOT, folders: tuple[str, ...] = PRODUCTION) -> list[ErrorClass]:
    """Every ``SpillwayError`` class (the base included) under ``folders``, with the code
    and status it declares or inherits."""
    by_dotted = {
        _dotted(p, root): _module(p, root)
        for folder in folders
        for p in (root / folder).rglob("*.py")
    }

    def resolve(module: _Module, base: ast.expr, seen: frozenset[str] = frozenset()) -> Key | None:
        if isinstance(base, ast.Name):
            if base.id in module.classes:
                return module.path, base.id
            source, name = module.names.get(base.id, ("", ""))
        elif isinstance(base, ast.Attribute) and isinstance(base.value, (ast.Name, ast.Attribute)):
            prefix = ast.unparse(base.value)
            imported = module.names.get(prefix)  # ``from a import b``, then ``b.Error``
            source = ".".join(imported) if imported else module.modules.get(prefix, prefix)
            name = base.attr
        else:
            return None
        target = by_dotted.get(source)
        if target is None or source in seen:  # a builtin, a library, or an import loop
            return None
        return resolve(target, ast.Name(name), seen | {source})

    modules = {m.path: m for m in by_dotted.values()}
    bases: dict[Key, list[Key]] = {
        (m.path, name): [k for b in node.bases if (k := resolve(m, b)) is not None]
        for m in modules.values()
        for name, node in m.classes.items()
    }

    def lineage(key: Key) -> Iterator[Key]:
        """The class, then its ancestors depth first (Python's MRO, for single bases)."""
        yield key
        for parent in bases[key]:
            yield from lineage(parent)

    def inherited(key: Key, field: str) -> object:
        for path, name in lineage(key):
            value = _own(modules[path].classes[name], field)
            if value is not None:
                return value
        return None

    found = []
    for key in bases:
        if BASE in lineage(key):
            code, status = inherited(key, "code"), inherited(key, "status")
            found.append(
                ErrorClass(
                    key[0],
                    key[1],
                    code if isinstance(code, str) else None,
                    status if isinstance(status, int) else None,
                )
            )
    return sorted(found, key=lambda e: (e.path, e.name))


def codes_with_two_statuses(errors: list[ErrorClass]) -> dict[str, list[str]]:
    """Each code declared with more than one status -> its classes, ``status path:Name``."""
    statuses: dict[str, set[int | None]] = {}
    for error in errors:
        if error.code is not None:
            statuses.setdefault(error.code, set()).add(error.status)
    return {
        code: sorted(f"{e.status} {e.path}:{e.name}" for e in errors if e.code == code)
        for code, found in sorted(statuses.items())
        if len(found) > 1
    }


def declared_elsewhere(errors: list[ErrorClass]) -> list[str]:
    """Error classes declared outside errors.py and not allow-listed, as ``path:Name``."""
    return [f"{e.path}:{e.name}" for e in errors if e.path != HOME and e.name not in NOT_YET_MOVED]


ERRORS = error_classes()


def test_the_reader_finds_the_hierarchy_with_inherited_codes_and_statuses() -> None:
    # GIVEN the error classes read from the production source
    found = {(e.path, e.name): (e.code, e.status) for e in ERRORS}
    # THEN the base, a class declaring both, and subclasses inheriting the status (and
    # one inheriting the code as well) are there, each with the pair Python gives it
    for name in (
        "SpillwayError",
        "InvalidInputError",
        "UnsupportedDatatypeError",
        "InsufficientMemoryError",
    ):
        cls = getattr(errors, name)
        assert found[HOME, name] == (cls.code, cls.status)
    assert found[HOME, "UnsupportedDatatypeError"] == ("unsupported_datatype", 400)
    assert len(ERRORS) > 40


def test_every_code_has_one_status() -> None:
    # GIVEN every error class of the production code
    # THEN no code is declared with two different statuses
    assert codes_with_two_statuses(ERRORS) == {}


def test_every_error_class_lives_in_the_error_module() -> None:
    # GIVEN every error class of the production code
    # THEN each is declared in spillway/protocol/errors.py (or allow-listed until it moves)
    assert declared_elsewhere(ERRORS) == []


def test_the_allow_list_is_current() -> None:
    # GIVEN every class the production code declares outside errors.py
    declared = {
        node.name
        for folder in PRODUCTION
        for path in (ROOT / folder).rglob("*.py")
        if str(path.relative_to(ROOT)) != HOME
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.ClassDef)
    }
    # THEN each allow-listed name is still one of them (else its entry goes)
    assert sorted(NOT_YET_MOVED - declared) == []


def test_the_checks_fail_on_a_second_status_and_on_an_error_outside(tmp_path: Path) -> None:
    # GIVEN a tree whose error module declares a code, and another module that declares
    # the same code with another status (the batch job's old ``not_configured``) and a
    # subclass there inheriting a code
    errors = tmp_path / "spillway" / "protocol" / "errors.py"
    errors.parent.mkdir(parents=True)
    errors.write_text(
        "class SpillwayError(Exception):\n    status = 500\n    code = 'internal'\n\n\n"
        "class NotConfiguredError(SpillwayError):\n    status = 400\n    code = 'not_configured'\n"
    )
    other = tmp_path / "batch_job" / "errors.py"
    other.parent.mkdir()
    other.write_text(
        "from spillway.protocol import errors\n"
        "from spillway.protocol.errors import SpillwayError as Base\n\n\n"
        "class NotConfiguredError(Base):\n    status: int = 500\n    code = 'not_configured'\n\n\n"
        "class Later(errors.NotConfiguredError):\n    pass\n\n\n"
        "class Unrelated(ValueError):\n    code = 'not_an_error_class'\n"
    )
    # WHEN the tree is read
    found = error_classes(tmp_path, ("spillway", "batch_job"))
    # THEN the code with two statuses and both classes outside the error module are named
    assert codes_with_two_statuses(found) == {
        "not_configured": [
            "400 batch_job/errors.py:Later",
            "400 spillway/protocol/errors.py:NotConfiguredError",
            "500 batch_job/errors.py:NotConfiguredError",
        ]
    }
    assert declared_elsewhere(found) == [
        "batch_job/errors.py:Later",
        "batch_job/errors.py:NotConfiguredError",
    ]
