"""No production module grows past 500 lines.

The project's rule for module size (the style guide's hint is ~300 lines; cohesion comes
first, so a cohesive module may pass that hint, never this limit): a module over
``MAX_LINES`` holds more than one job and is split along a real seam, each part its own
module with a docstring saying what it owns, not cut into pieces to meet the number.

GIVEN every Python module of the production folders (``PRODUCTION``: the core, the CLI,
the GPU service, the Lambda functions, the batch job and the infrastructure checks; not
tests/ or bench/)
WHEN its lines are counted
THEN none has more than ``MAX_LINES``; the failure lists each offender with its count,
largest first.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("spillway", "spillway_cli", "gpu_service", "functions", "batch_job", "infra")
MAX_LINES = 500


def _line_counts() -> dict[str, int]:
    """Each production module (its path from the repository root) and its line count."""
    return {
        path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for top in PRODUCTION
        for path in sorted((ROOT / top).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def test_every_production_folder_is_counted() -> None:
    # GIVEN the production folders WHEN their modules are listed
    counted = _line_counts()
    # THEN each folder contributes modules (a renamed folder would empty the rule silently)
    assert {path.split("/", 1)[0] for path in counted} == set(PRODUCTION)


def test_no_production_module_exceeds_the_limit() -> None:
    # GIVEN every production module WHEN its lines are counted
    over = sorted(
        ((count, path) for path, count in _line_counts().items() if count > MAX_LINES),
        key=lambda item: (-item[0], item[1]),
    )
    # THEN none is over the limit; the message names each offender, largest first
    shown = "\n".join(f"  {path}: {count}" for count, path in over)
    assert not over, (
        f"{len(over)} modules over {MAX_LINES} lines (split each along a real seam):\n{shown}"
    )
