"""docs/mutation.md from the mutation runs' results (``make mutation``; the runs are
``scripts/mutation.py``'s): per module its tests, mutants, killed, timed out, survived and
score, and every mutant not killed with the reviewed reason of
scripts/mutation_reasons.toml, or **unreviewed**."""

from __future__ import annotations

import json
import re
import textwrap
import tomllib
from typing import Any

from mutation import COMMAND, DOC, REASONS, ROOT, RUNS, load_config, score


def load_reasons() -> dict[str, dict[str, str]]:
    with REASONS.open("rb") as f:
        reasons: dict[str, dict[str, str]] = tomllib.load(f)
    return reasons


def mutated_lines(diff: str) -> list[str]:
    """The lines a mutant's diff adds, stripped."""
    return [
        line[1:].strip()
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]


def reason_for(name: str, diff: str, reasons: dict[str, dict[str, str]]) -> str:
    """The reviewed reason for a survivor, or why there is none. A reason names the line
    the mutant wrote; when mutant numbers move (the module changed), a reason whose line
    is no longer the mutant's is not used."""
    entry = reasons.get(name)
    if entry is None:
        return "**unreviewed**"
    if entry["line"].strip() not in mutated_lines(diff):
        return "**unreviewed** (the reason on file was for another change: the module moved)"
    return entry["reason"]


def short_name(name: str, path: str) -> str:
    module = path.removesuffix(".py").replace("/", ".") + "."
    return name.removeprefix(module).replace("xǁ", "").replace("ǁ", ".").replace("x_", "", 1)


def others(counts: dict[str, int]) -> str:
    """The not-killed counts by status, e.g. ``3 no tests, 2 survived``."""
    return ", ".join(
        f"{n} {s}" for s, n in sorted(counts.items()) if s not in ("killed", "timeout")
    )


def own_settings(name: str) -> dict[str, Any]:
    """The mutmut settings a module's entry overrides."""
    for module in load_config()["modules"]:
        if module["name"] == name:
            own: dict[str, Any] = module.get("mutmut", {})
            return own
    return {}


def module_section(result: dict[str, Any], reasons: dict[str, dict[str, str]]) -> list[str]:
    counts = result["counts"]
    total = sum(counts.values())
    killed, timeouts = counts.get("killed", 0), counts.get("timeout", 0)
    out = [
        f"### `{result['path']}`",
        "",
        f"Tests: {', '.join(f'`{t}`' for t in result['tests'])}.",
        f"Finished {result['finished']}, {result['wall_s']} s wall time"
        f" ({result['jobs']} worker{'s' if result['jobs'] != 1 else ''});"
        f" time-outs of the full pass run again alone: {result['timeouts_rerun']}."
        + (
            f" Hypothesis tests capped at {result['max_examples']} examples."
            if result.get("max_examples")
            else ""
        )
        + "".join(f" Own setting: `{k} = {v}`." for k, v in own_settings(result["name"]).items()),
        "",
        f"{total} mutants: {killed} killed by a failing test, {timeouts} timed out,"
        f" {total - killed - timeouts} survived"
        + (f" ({others(counts)})" if total - killed - timeouts else "")
        + f". **Score {score(result):.1f} %** (killed by a failing test / mutants).",
        "",
    ]
    for kind, title in (("timeout", "Timed out"), (None, "Survived")):
        names = [
            n
            for n, s in result["statuses"].items()
            if (s == kind if kind else s not in ("killed", "timeout"))
        ]
        if not names:
            continue
        out += [f"{title}:", ""]
        for name in names:
            diff = result["diffs"].get(name, "")
            change = "; ".join(f"`{line}`" for line in mutated_lines(diff)) or "(no diff)"
            state = (
                ""
                if kind or result["statuses"][name] == "survived"
                else f" [{result['statuses'][name]}]"
            )
            why = reason_for(name, diff, reasons)
            out.append(f"- `{short_name(name, result['path'])}`{state}: {change} — {why}")
        out.append("")
    return out


def write(why_missing: str = "") -> None:
    """docs/mutation.md from the kept results and the reviewed reasons."""
    config = load_config()
    reasons = load_reasons()
    results = []
    missing = []
    for module in config["modules"]:
        kept = RUNS / module["name"] / "result.json"
        if kept.is_file():
            results.append(json.loads(kept.read_text()))
        else:
            missing.append(module)
    lines = header(results)
    lines += table(results, missing)
    lines += ["## Modules", ""]
    for result in results:
        lines += module_section(result, reasons)
    skipped = config.get("not_run", [])
    if missing or skipped:
        lines += ["## Not run", ""]
        for m in missing:
            why = why_missing or "no result in build/mutation/"
            lines.append(f"- `{m['path']}`: {why}.")
        for m in skipped:
            lines.append(f"- `{m['path']}`: {m['why']}.")
        lines.append("")
    lines += how_it_runs()
    DOC.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {DOC.relative_to(ROOT)}")


def header(results: list[dict[str, Any]]) -> list[str]:
    versions = sorted({r["mutmut"] for r in results}) or ["(none run)"]
    finished = sorted(r["finished"] for r in results)
    when = f"{finished[0]} to {finished[-1]}" if finished else "never"
    shared = load_config()["mutmut"]
    paragraphs = [
        "A mutation run changes one operator, constant or argument of a module at a time (a"
        " *mutant*) and runs the unit tests that cover the module against it; a mutant no"
        " test notices *survives*. Every mutant of each module below was run (no sample),"
        " each module against its own unit tests only.",
        f"mutmut {', '.join(versions)}; runs finished {when}; command: `{COMMAND}`"
        " (some modules: `MUTATE='<name> ...'`, names as in scripts/mutation.toml).",
        "**Killed**: a selected test failed. **Timed out**: the tests ran past"
        f" {shared['timeout_multiplier']:g} × their clean time + {shared['timeout_constant']:g} s,"
        " in the full pass and again when run alone afterwards (so that load on a shared"
        " machine is not taken for a hang); not counted as killed. **Survived**: neither,"
        " including mutants no selected test reaches (*no tests*). The **score** is killed /"
        " mutants.",
        "Hypothesis tests play the same examples on every run (derandomized, no example"
        " database) and stop at the first failing example (no shrinking); where a module's"
        " entry caps them, at most that many examples (the module's section says so).",
    ]
    out = [
        "# Mutation testing",
        "",
        "<!-- Generated by scripts/mutation_report.py from build/mutation/*/result.json and",
        "     scripts/mutation_reasons.toml. Do not edit: run `make mutation`. -->",
        "",
    ]
    for paragraph in paragraphs:
        # a code span is one word: never broken across lines
        words = re.findall(r"`[^`]*`\S*|\S+", paragraph)
        out += [
            textwrap.fill(" ".join(w.replace(" ", "\0") for w in words), width=90).replace(
                "\0", " "
            ),
            "",
        ]
    return out


def table(results: list[dict[str, Any]], missing: list[dict[str, Any]]) -> list[str]:
    out = [
        "## Scores",
        "",
        "| module | mutants | killed | timed out | survived | score | wall time |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r["counts"]
        total = sum(c.values())
        k, t = c.get("killed", 0), c.get("timeout", 0)
        out.append(
            f"| `{r['path']}` | {total} | {k} | {t} | {total - k - t} | **{score(r):.1f} %** |"
            f" {r['wall_s']} s |"
        )
    for m in missing:
        out.append(f"| `{m['path']}` | not run | | | | | |")
    out.append("")
    return out


def how_it_runs() -> list[str]:
    return [
        "## How it runs",
        "",
        "`make mutation` installs mutmut into `.venv-mutation` (its own environment: it brings",
        "its own pytest; the project's packages are reached through a `.pth` file naming",
        "`.venv`'s site-packages), then `scripts/mutation.py run` takes each module of",
        "`scripts/mutation.toml` in turn: a copy of the working tree in `build/mutation/<name>/`",
        "whose `pyproject.toml` gains a `[tool.mutmut]` table (`only_mutate`: the module;",
        "`pytest_add_cli_args_test_selection`: its tests), then `mutmut run` over every mutant",
        "and once more over the time-outs; `scripts/mutation.py report` (`mutation_report.py`)",
        "writes this page.",
        "A survivor's reason comes from `scripts/mutation_reasons.toml` (reviewed equivalent",
        "mutants, keyed by mutant name, each with the line the mutant writes so a renumbered",
        "mutant is not given another's reason).",
        "",
        "```sh",
        "make mutation                          # every module, then this page",
        "make mutation MUTATE='health decision'  # some (the others keep their last result)",
        "cd build/mutation/<name> && ../../../.venv-mutation/bin/mutmut show <mutant>  # a diff",
        "```",
    ]
