"""The local commands' terminal is a report: log lines go to a file unless asked for."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from spillway_cli.console import (
    Check,
    CheckFailed,
    Checks,
    at_least,
    at_most,
    equal,
    report_logging,
)


@pytest.fixture
def root() -> Iterator[logging.Logger]:
    logger = logging.getLogger()
    handlers, level = list(logger.handlers), logger.level
    logger.handlers = []
    try:
        yield logger
    finally:
        for handler in logger.handlers:
            handler.close()
        logger.handlers, logger.level = handlers, level


@pytest.mark.parametrize("verbose", [False, True])
def test_info_lines_reach_the_terminal_only_when_verbose(
    root: logging.Logger, tmp_path: Path, capsys: pytest.CaptureFixture[str], verbose: bool
) -> None:
    log_file = tmp_path / "out" / "demo.log"
    report_logging(log_file, verbose)
    logging.getLogger("botocore.credentials").info("Found credentials in environment variables.")
    logging.getLogger("spillway.stack").warning("gpu did not come up")
    for handler in root.handlers:
        handler.flush()
    terminal = capsys.readouterr().err
    written = log_file.read_text()
    assert "Found credentials" in written
    assert "gpu did not come up" in written
    assert "gpu did not come up" in terminal
    assert ("Found credentials" in terminal) is verbose


# --- checks ---------------------------------------------------------------------------------


def test_a_failed_check_prints_its_section_name_figure_and_bound() -> None:
    # GIVEN the demo's session check fed the figure of the failing run (39 of 40)
    said: list[str] = []
    checks = Checks(said.append)
    sessions = equal("every session kept one version while the canary ran", 39, 40, "sessions")
    # WHEN it is recorded beside a passing check
    passed = checks.record("7. canary", [at_most("failed", 0, 0), sessions])
    # THEN the section fails and one line names the check, the figure and the bound
    assert passed is False
    assert said == [
        "   CHECK FAILED [7. canary] every session kept one version while the canary ran: "
        "39 sessions (bound: = 40 sessions)"
    ]
    # AND the closing verdict lists it again, with the count of checks made
    assert checks.verdict().splitlines() == [
        "1 of 2 checks FAILED:",
        "  [7. canary] every session kept one version while the canary ran: 39 sessions "
        "(bound: = 40 sessions)",
    ]


@pytest.mark.parametrize(
    ("check", "passed", "line"),
    [
        (at_least("accuracy", 0.8911, 0.9), False, "accuracy: 0.8911 (bound: >= 0.9)"),
        (at_least("accuracy", 0.9689, 0.9), True, "accuracy: 0.9689 (bound: >= 0.9)"),
        (at_most("rolled back", None, 3000, "requests"), False, "rolled back: none "
         "(bound: <= 3000 requests)"),
        (at_most("rolled back", 3000, 3000, "requests"), True, "rolled back: 3000 requests "
         "(bound: <= 3000 requests)"),
        (equal("pinned", 200, 409, "(HTTP status)"), False, "pinned: 200 (HTTP status) "
         "(bound: = 409 (HTTP status))"),
        (equal("job", "FAILED", "SUCCEEDED"), False, "job: FAILED (bound: = SUCCEEDED)"),
    ],
)  # fmt: skip
def test_a_check_decides_from_its_figures(check: Check, passed: bool, line: str) -> None:
    # GIVEN a figure and a bound  THEN the verdict and the printed line agree with them
    assert check.passed is passed
    assert check.describe() == line


def test_every_check_passed_says_how_many() -> None:
    said: list[str] = []
    checks = Checks(said.append)
    assert checks.record("1. digits", [at_least("accuracy", 0.97, 0.9)]) is True
    assert said == []
    assert checks.verdict() == "All 1 checks passed."


def test_a_required_check_that_fails_stops_the_run_naming_it() -> None:
    # GIVEN the GPU service never came back within the deadline
    said: list[str] = []
    checks = Checks(said.append)
    check = at_most("the router went back to the GPU service", None, 240, "s")
    # WHEN the demo requires it  THEN the run stops with the check, printed first
    with pytest.raises(CheckFailed) as stopped:
        checks.require("5. GPU killed", check)
    assert stopped.value.check == check
    assert said == [
        "   CHECK FAILED [5. GPU killed] the router went back to the GPU service: none "
        "(bound: <= 240 s)"
    ]
