"""The local commands' terminal is a report: log lines go to a file unless asked for."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from spillway_cli.console import report_logging


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
