"""Build the demo model repository: ``digits``, ``mlp-bench``, ``minilm``, the ``topics``
pipeline (with its ``topics-head``), the OCR models ``ocr-det``, ``ocr-cls``, ``ocr-rec``,
``ocr-lines`` and the ``ocr`` and ``ocr-topics`` pipelines.

``python -m spillway_cli.modelbuild.build --out models [MODEL ...]`` builds all of them
(or the named ones) and logs one line per model.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from spillway_cli.modelbuild.common import BuildReport
from spillway_cli.modelbuild.digits import build_digits
from spillway_cli.modelbuild.minilm import build_minilm
from spillway_cli.modelbuild.mlp import build_mlp
from spillway_cli.modelbuild.ocr import build_ocr_cls, build_ocr_det, build_ocr_rec
from spillway_cli.modelbuild.ocr_pipelines import (
    build_ocr_lines,
    build_ocr_pipeline,
    build_ocr_topics,
)
from spillway_cli.modelbuild.topics import build_topics

logger = logging.getLogger(__name__)

# Cheap builds first, so a failure in the slow torch export does not hide them.
BUILDERS: dict[str, Callable[[Path], BuildReport]] = {
    "digits": build_digits,
    "mlp-bench": build_mlp,
    "minilm": build_minilm,
    "topics": build_topics,  # after minilm: its head is built from minilm's embeddings
    "ocr-det": build_ocr_det,
    "ocr-cls": build_ocr_cls,
    "ocr-rec": build_ocr_rec,
    "ocr-lines": build_ocr_lines,  # after ocr-rec: its check reads a line with it
    "ocr": build_ocr_pipeline,
    "ocr-topics": build_ocr_topics,  # after topics and the OCR models it chains
}


def build_repository(out: Path, models: list[str] | None = None) -> dict[str, BuildReport]:
    """Build ``models`` (default: all) into the repository ``out``; returns a report each.

    Rebuilding overwrites: each model is built in a staging directory and swapped in.
    Raises ValueError for an unknown model name and RuntimeError when a check fails.
    """
    names = list(BUILDERS) if models is None else list(dict.fromkeys(models))
    unknown = [name for name in names if name not in BUILDERS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {sorted(BUILDERS)}")
    out.mkdir(parents=True, exist_ok=True)
    return {name: BUILDERS[name](out) for name in names}


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("models"), help="repository root")
    parser.add_argument("models", nargs="*", help=f"any of {', '.join(BUILDERS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(BUILDERS))
    if unknown:
        parser.error(f"unknown model(s): {', '.join(unknown)}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    reports = build_repository(args.out, args.models or None)
    total = sum(report.seconds for report in reports.values())
    logger.info("built %d model(s) into %s in %.1fs", len(reports), args.out, total)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
