"""What the local commands (``spillway up``, ``make demo``) show in the terminal: a
report, while log lines go to files; and the demo's checks, each a figure against its
bound, reported by name when one fails."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path


def report_logging(log_file: Path, verbose: bool) -> None:
    """Every log line to ``log_file``; in the terminal only warnings and errors (every
    line when ``verbose``), so that the terminal reads as a report. The services started
    by the stack write their own logs next to it."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    form = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    to_file = logging.FileHandler(log_file, encoding="utf-8")
    to_terminal = logging.StreamHandler()
    to_terminal.setLevel(logging.INFO if verbose else logging.WARNING)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in (to_file, to_terminal):
        handler.setFormatter(form)
        root.addHandler(handler)


# --- checks -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One check: what was measured (``figure``) against what it must be (``bound``).

    Build it with ``at_least``, ``at_most`` or ``equal``, which decide ``passed`` from
    the numbers, so that a check's verdict and the figures it prints cannot disagree.
    """

    name: str
    figure: str
    bound: str
    passed: bool

    def describe(self) -> str:
        """``name: figure (bound: ...)``, the line a failed check prints."""
        return f"{self.name}: {self.figure} (bound: {self.bound})"


def _number(value: float, unit: str) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{text} {unit}".rstrip()


def at_least(name: str, figure: float | None, bound: float, unit: str = "") -> Check:
    """``figure >= bound``; ``None`` (nothing measured) fails."""
    shown = "none" if figure is None else _number(figure, unit)
    passed = figure is not None and figure >= bound
    return Check(name, shown, f">= {_number(bound, unit)}", passed)


def at_most(name: str, figure: float | None, bound: float, unit: str = "") -> Check:
    """``figure <= bound``; ``None`` (nothing measured) fails."""
    shown = "none" if figure is None else _number(figure, unit)
    passed = figure is not None and figure <= bound
    return Check(name, shown, f"<= {_number(bound, unit)}", passed)


def equal(name: str, figure: object, bound: object, unit: str = "") -> Check:
    """``figure == bound`` (numbers, statuses, states)."""
    shown = "none" if figure is None else f"{figure} {unit}".rstrip()
    return Check(name, shown, f"= {bound} {unit}".rstrip(), figure == bound)


class CheckFailed(RuntimeError):
    """A check the rest of the run depends on failed (e.g. the GPU service never came
    back): the run stops there and says which check it was."""

    def __init__(self, section: str, check: Check) -> None:
        super().__init__(f"[{section}] {check.describe()}")
        self.section = section
        self.check = check


@dataclass
class Checks:
    """The checks of a run, by section, in the order they were made. A failed check is
    printed as it is recorded (section, name, figure and bound) through ``say``."""

    say: Callable[[str], None]
    made: list[tuple[str, Check]] = field(default_factory=list)

    def record(self, section: str, checks: Iterable[Check]) -> bool:
        """Record a section's checks; whether they all passed."""
        passed = True
        for check in checks:
            self.made.append((section, check))
            if not check.passed:
                passed = False
                self.say(f"   CHECK FAILED [{section}] {check.describe()}")
        return passed

    def require(self, section: str, check: Check) -> None:
        """Record a check the rest of the run depends on; ``CheckFailed`` if it failed."""
        if not self.record(section, [check]):
            raise CheckFailed(section, check)

    @property
    def failed(self) -> list[tuple[str, Check]]:
        """The failed checks with their sections."""
        return [(section, check) for section, check in self.made if not check.passed]

    def verdict(self) -> str:
        """The closing lines: every check passed, or which ones failed and by how much."""
        failed = self.failed
        if not failed:
            return f"All {len(self.made)} checks passed."
        lines = [f"{len(failed)} of {len(self.made)} checks FAILED:"]
        lines += [f"  [{section}] {check.describe()}" for section, check in failed]
        return "\n".join(lines)
