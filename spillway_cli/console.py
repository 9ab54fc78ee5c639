"""What the local commands (``spillway up``, ``make demo``) show in the terminal: a
report, while log lines go to files."""

from __future__ import annotations

import logging
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
