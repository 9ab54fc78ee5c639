"""Mutation testing you can repeat: `make mutation` (docs/mutation.md).

``run [NAME ...]`` runs every mutant of each module of scripts/mutation.toml (all of them,
or the ones named) against that module's unit tests, with mutmut in its own environment,
and keeps each module's result in build/mutation/<name>/result.json. ``report`` writes
docs/mutation.md from those results and the reviewed reasons of
scripts/mutation_reasons.toml; a survivor without a reason is listed as unreviewed.

A time-out is not a kill by a failing test: the time-outs of a full pass are run once
more, alone (one worker), so that a mutant that only ran slow on a busy machine gets its
real result, and the report counts those still timing out apart from the killed ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "scripts" / "mutation.toml"
REASONS = ROOT / "scripts" / "mutation_reasons.toml"
RUNS = ROOT / "build" / "mutation"
DOC = ROOT / "docs" / "mutation.md"

# mutmut 3.8.1's exit codes (mutmut/stats.py, status_by_exit_code), folded into the
# report's four columns: killed by a failing test, timed out, survived, other.
KILLED = {1, 3}
TIMEOUT = {36, 24, -24, 152, 255}
SURVIVED = {0}
NO_TESTS = {5, 33}

COMMAND = "make mutation"


def load_config() -> dict[str, Any]:
    with CONFIG.open("rb") as f:
        return tomllib.load(f)


def status(exit_code: int | None) -> str:
    """The report's name for a mutant's exit code."""
    if exit_code in KILLED:
        return "killed"
    if exit_code in TIMEOUT:
        return "timeout"
    if exit_code in SURVIVED:
        return "survived"
    if exit_code in NO_TESTS:
        return "no tests"
    if exit_code is None:
        return "not checked"
    return f"other ({exit_code})"


def toml_value(value: object) -> str:
    """``value`` as TOML (the few types the mutmut table holds)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


PLUGIN = "mutation_examples"
PLUGIN_CODE = '''"""A pytest plugin for mutation runs only (written by scripts/mutation.py): every
hypothesis test plays the same examples on every run (derandomize, no example database),
stops at its first failing example (no shrinking: a mutant needs a failure, not the
smallest one), and plays no more than MAX_EXAMPLES where the module's entry in
scripts/mutation.toml sets ``max_examples`` (None: the test's own number)."""

from hypothesis import Phase, settings

MAX_EXAMPLES = None


def pytest_collection_modifyitems(items):
    for item in items:
        test = getattr(item, "obj", None)
        if not getattr(test, "is_hypothesis_test", False):
            continue
        own = test._hypothesis_internal_use_settings
        examples = own.max_examples if MAX_EXAMPLES is None else min(own.max_examples, MAX_EXAMPLES)
        test._hypothesis_internal_use_settings = settings(
            own,
            max_examples=examples,
            derandomize=True,
            database=None,
            phases=(Phase.explicit, Phase.generate),
        )
'''


def prepare(module: dict[str, Any], shared: dict[str, Any], workdir: Path) -> None:
    """A fresh copy of the working tree (tracked and new files, nothing ignored) in
    ``workdir``, its pyproject.toml ending in the module's ``[tool.mutmut]``."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],  # noqa: S607
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        name = raw.decode()
        source = ROOT / name
        if not name or not source.is_file():  # deleted but still in the index
            continue
        target = workdir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    plugin = PLUGIN_CODE.replace(
        "MAX_EXAMPLES = None", f"MAX_EXAMPLES = {module.get('max_examples')}"
    )
    (workdir / f"{PLUGIN}.py").write_text(plugin)
    settings = dict(shared)
    settings["also_copy"] = [*shared.get("also_copy", []), f"{PLUGIN}.py"]
    settings["pytest_add_cli_args"] = [*shared.get("pytest_add_cli_args", []), "-p", PLUGIN]
    settings.update(module.get("mutmut", {}))  # the module's own settings, if any
    settings["only_mutate"] = [module["path"]]
    settings["pytest_add_cli_args_test_selection"] = list(module["tests"])
    lines = ["", "[tool.mutmut]"] + [f"{k} = {toml_value(v)}" for k, v in settings.items()]
    pyproject = workdir / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "\n".join(lines) + "\n")


def mutmut(workdir: Path, args: list[str], log: Path) -> None:
    """``mutmut ARGS`` in ``workdir``, its output appended to ``log``."""
    with log.open("a") as out:
        out.write(f"\n$ mutmut {' '.join(args)}\n")
        out.flush()
        done = subprocess.run(  # noqa: S603 - mutmut of this environment, our arguments
            [sys.executable, "-m", "mutmut", *args],
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"mutmut {args[0]} failed in {workdir} (exit {done.returncode}): {log}")


def exit_codes(workdir: Path, path: str) -> dict[str, int | None]:
    meta = json.loads((workdir / "mutants" / f"{path}.meta").read_text())
    codes: dict[str, int | None] = meta["exit_code_by_key"]
    return codes


DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant
names = json.load(sys.stdin)
print(json.dumps({n: get_diff_for_mutant(n, path=find_mutant(n).path) for n in names}))
"""


def diffs(workdir: Path, names: list[str]) -> dict[str, str]:
    """Each named mutant's diff, as ``mutmut show`` prints it."""
    if not names:
        return {}
    done = subprocess.run(  # noqa: S603 - this environment's python, our code
        [sys.executable, "-c", DIFFS],
        cwd=workdir,
        input=json.dumps(names),
        capture_output=True,
        text=True,
        check=True,
    )
    found: dict[str, str] = json.loads(done.stdout)
    return found


def run_module(module: dict[str, Any], shared: dict[str, Any], jobs: int) -> dict[str, Any]:
    """Every mutant of one module; its result, also kept in build/mutation/<name>/."""
    workdir = RUNS / module["name"]
    started = time.monotonic()
    prepare(module, shared, workdir)
    log = workdir / "mutmut.log"
    mutmut(workdir, ["run", "--max-children", str(jobs)], log)
    codes = exit_codes(workdir, module["path"])
    first_timeouts = sorted(n for n, c in codes.items() if status(c) == "timeout")
    if first_timeouts:
        mutmut(workdir, ["run", "--max-children", "1", *first_timeouts], log)
        codes = exit_codes(workdir, module["path"])
    wall_s = time.monotonic() - started
    statuses = {n: status(c) for n, c in sorted(codes.items())}
    not_killed = [n for n, s in statuses.items() if s != "killed"]
    result = {
        "name": module["name"],
        "path": module["path"],
        "tests": list(module["tests"]),
        "finished": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "mutmut": mutmut_version(),
        "wall_s": round(wall_s),
        "jobs": jobs,
        "max_examples": module.get("max_examples"),
        "timeouts_rerun": len(first_timeouts),
        "counts": dict(Counter(statuses.values())),
        "statuses": statuses,
        "diffs": diffs(workdir, not_killed),
    }
    (workdir / "result.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    return result


def mutmut_version() -> str:
    from importlib.metadata import version

    return version("mutmut")


def changed_recently(path: str, quiet_s: float) -> bool:
    """Whether ``path`` is missing or changed in the last ``quiet_s`` seconds: a module
    someone is editing is not run until it settles."""
    target = ROOT / path
    if not target.exists():
        return True
    return time.time() - target.stat().st_mtime < quiet_s


def cmd_run(args: argparse.Namespace) -> None:
    config = load_config()
    modules = config["modules"]
    known = {m["name"] for m in modules}
    unknown = set(args.names) - known
    if unknown:
        raise SystemExit(
            f"unknown module(s) {sorted(unknown)}; scripts/mutation.toml has {sorted(known)}"
        )
    chosen = [m for m in modules if not args.names or m["name"] in args.names]
    for module in chosen:
        if args.quiet_s and changed_recently(module["path"], args.quiet_s):
            print(f"{module['name']}: {module['path']} changed lately; not run", flush=True)
            continue
        print(f"{module['name']}: mutating {module['path']} ...", flush=True)
        result = run_module(module, config["mutmut"], args.jobs)
        print(f"{module['name']}: {summary_line(result)} in {result['wall_s']} s", flush=True)


def summary_line(result: dict[str, Any]) -> str:
    counts = result["counts"]
    total = sum(counts.values())
    return (
        f"{total} mutants, {counts.get('killed', 0)} killed, {counts.get('timeout', 0)} timed out,"
        f" {total - counts.get('killed', 0) - counts.get('timeout', 0)} not killed,"
        f" score {score(result):.1f} %"
    )


def score(result: dict[str, Any]) -> float:
    """Mutants killed by a failing test, in per cent of all the module's mutants."""
    counts = result["counts"]
    total = sum(counts.values())
    return 100.0 * counts.get("killed", 0) / total if total else 0.0


def cmd_report(args: argparse.Namespace) -> None:
    import mutation_report  # scripts/ is on the path of `python scripts/mutation.py`

    mutation_report.write(args.why_missing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(required=True)
    run = sub.add_parser("run", help="run the modules' mutants")
    run.add_argument("names", nargs="*", help="module names of scripts/mutation.toml (all: none)")
    run.add_argument("--jobs", type=int, default=int(os.environ.get("MUTATION_JOBS", "1")))
    run.add_argument(
        "--quiet-s",
        type=float,
        default=0.0,
        help="skip a module whose file changed in the last QUIET_S seconds",
    )
    run.set_defaults(func=cmd_run)
    report = sub.add_parser("report", help="write docs/mutation.md")
    report.add_argument("--why-missing", default="", help="why a module has no result")
    report.set_defaults(func=cmd_report)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
