"""The demo numbers its sections in one place: the headings it prints, run over its own
list of sections (each section's run replaced, so no stack runs), are numbered 1..N in
order, once each, and each section's checks carry its heading's number; no section module
writes a number of its own."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any, cast

from spillway_cli.console import Check, Checks, equal
from spillway_cli.demo.sections import (
    CANARY,
    SECTIONS,
    Demo,
    Section,
    number,
    recorded,
    run_sections,
)

DEMO = Path(__file__).resolve().parents[2] / "spillway_cli" / "demo"
NUMBERED = re.compile(r"^(\d+)\. ")


def _section_saying(section: Section, lines: list[str]) -> Section:
    """``section`` with its run replaced: it says ``lines`` (as a section module does,
    indented) and makes one passing check."""

    def run(demo: Demo, _name: str) -> list[Check]:
        for line in lines:
            demo.say(line)
        return [equal("ran", 1, 1)]

    return dataclasses.replace(section, run=run)


def _run(sections: tuple[Section, ...]) -> tuple[list[str], Checks]:
    said: list[str] = []
    checks = Checks(said.append)
    fake = cast(Any, None)  # no stack, client or folders: the replaced runs use none
    run_sections(Demo(fake, fake, fake, fake, checks, said.append), sections)
    return "\n".join(said).splitlines(), checks


def test_the_printed_section_numbers_are_1_to_n_in_order_once_each() -> None:
    # GIVEN the demo's own sections, each saying what a section says (a section with two
    # sets of frames says two blocks)
    sections = tuple(
        _section_saying(s, ["   50 streams x 20 digits frames", "   20 streams x 2 OCR pages"])
        for s in SECTIONS
    )
    # WHEN the demo runs them
    lines, checks = _run(sections)
    # THEN the numbered headings are 1..N in order, no number given twice
    numbers = [int(m.group(1)) for line in lines if (m := NUMBERED.match(line))]
    assert numbers == list(range(1, len(SECTIONS) + 1))
    # AND each heading is its section's, under the number its checks carry
    headings = [line for line in lines if NUMBERED.match(line)]
    assert headings == [f"{n}. {s.heading}" for n, s in enumerate(SECTIONS, 1)]
    assert [name for name, _ in checks.made] == [
        f"{n}. {s.name}" for n, s in enumerate(SECTIONS, 1)
    ]


def test_the_sections_are_distinct_and_the_derived_numbers_agree() -> None:
    # GIVEN the demo's sections
    # THEN no section is listed twice, by name or by heading
    assert len({s.name for s in SECTIONS}) == len(SECTIONS)
    assert len({s.heading for s in SECTIONS}) == len(SECTIONS)
    # AND the numbers the closing report names come from the same list
    assert number(CANARY) == SECTIONS.index(CANARY) + 1 == 7
    assert recorded() == "sections 1, 2, 3, 5, 6"
    # AND a list in another order numbers its sections anew
    reordered = (SECTIONS[1], SECTIONS[0])
    assert number(SECTIONS[0], reordered) == 2
    assert recorded(reordered) == "sections 1, 2"


def _strings(path: Path) -> list[str]:
    """Every string literal of a module, the literal parts of f-strings included."""
    tree = ast.parse(path.read_text())
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_no_section_module_writes_a_section_number() -> None:
    # GIVEN every module of the demo
    # THEN none writes a numbered heading ("\n10. frame streams ...") or a check name with a
    # number in it: the numbers come from the list of sections only
    numbered = re.compile(r"^\n*\d+\. \S")
    found = {
        path.name: text
        for path in sorted(DEMO.glob("*.py"))
        for text in _strings(path)
        if numbered.match(text)
    }
    assert found == {}
