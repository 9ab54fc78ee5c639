"""``python -m infra.checks.second_deploy``: run the three rules, print what they found.

Prints, per template and parameter, what a change of that parameter replaces; exits 1 on
a finding of any rule, a stale lock or stale generated tables in docs/deploy.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infra.checks.second_deploy import Report
from infra.checks.second_deploy.docs import DOCS, check_docs, exports_table, identity_table
from infra.checks.second_deploy.exports import check_exports, exports, link_imports
from infra.checks.second_deploy.lock import LOCK, UPDATE_COMMAND, check_lock, lock_entries
from infra.checks.second_deploy.replacement import check_parameters, replacements
from infra.checks.second_deploy.templates import ROOT, load_templates


def run(root: Path, *, update: bool, write_docs: bool, translated: Path | None) -> Report:
    """Check (or regenerate) everything under ``root``."""
    templates = load_templates(root, translated)
    report = Report()
    found = exports(templates)
    report.problems += link_imports(templates, found)
    replaced = replacements(templates)
    check_parameters(templates, replaced, report)
    check_exports(templates, found, replaced, report)
    check_lock(root / LOCK, lock_entries(templates), report, update=update)
    blocks = {"identity": identity_table(), "exports": exports_table(found, templates)}
    check_docs(root / DOCS, blocks, report, write=update or write_docs)
    imported = sum(1 for e in found if e.importers)
    report.lines.append(f"  exports: {len(found)} ({imported} imported by another template)")
    return report


def main(argv: list[str] | None = None) -> int:
    """Print what each parameter change replaces; exit 1 on a finding."""
    parser = argparse.ArgumentParser(prog="python -m infra.checks.second_deploy")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (or a copy)")
    parser.add_argument("--translated", type=Path, help="template.yaml already translated")
    parser.add_argument("--update", action="store_true", help="re-lock on purpose, rewrite docs")
    parser.add_argument("--write-docs", action="store_true", help="rewrite the docs tables")
    args = parser.parse_args(argv)
    report = run(args.root, update=args.update, write_docs=args.write_docs,
                 translated=args.translated)  # fmt: skip
    print("what a parameter change replaces (resource (cause)):")
    print("\n".join(report.lines))
    if report.problems:
        print(f"\nsecond deploy: {len(report.problems)} problems", file=sys.stderr)
        print("\n".join(f"  {p}" for p in report.problems), file=sys.stderr)
        print(
            f"\nIf a replacement is intended (the data may go), re-lock on purpose: "
            f"{UPDATE_COMMAND}",
            file=sys.stderr,
        )
        return 1
    print("\nsecond deploy: no stateful or named resource replaced, no export in use changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
