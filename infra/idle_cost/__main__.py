"""What each deploy shape costs a month while idle, computed from the templates.

``python -m infra.idle_cost`` writes the table into docs/deploy.md; with ``--check`` it
exits 1 when the table there differs.
"""

from __future__ import annotations

import argparse
import sys

from infra.idle_cost.report import DOC, render, replace_between_markers


def main(argv: list[str] | None = None) -> int:
    """Write the table into docs/deploy.md, or (``--check``) fail when it differs."""
    parser = argparse.ArgumentParser(
        prog="python -m infra.idle_cost", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when the doc differs")
    args = parser.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    updated = replace_between_markers(text, render())
    if updated == text:
        print("docs/deploy.md: idle cost up to date")
        return 0
    if args.check:
        print("docs/deploy.md: the idle cost table is stale: run `python -m infra.idle_cost`",
              file=sys.stderr)  # fmt: skip
        return 1
    DOC.write_text(updated, encoding="utf-8")
    print("docs/deploy.md: idle cost table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
