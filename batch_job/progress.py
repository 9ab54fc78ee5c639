"""Progress of a job run: periodic log lines, and a progress bar on a terminal.

The log lines are what CloudWatch Logs shows for a Batch child; the bar is for people
running ``spillway jobs run`` by hand. Both count records done against the records of the
shards started so far (a shard's total is known once its input is downloaded).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("spillway.jobs.progress")


class Progress:
    """Records and shards done; a log line every ``interval_s`` and at each shard's end."""

    def __init__(
        self,
        shards: int,
        interval_s: float,
        *,
        bar: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shards = shards
        self.interval_s = interval_s
        self.clock = clock
        self.started = clock()
        self.shards_done = 0
        self.records = 0
        self.errors = 0
        self.shard_name = ""
        self.shard_records = 0
        self.shard_total: int | None = None
        self._last_line = self.started
        self._bar: Any = None
        self._task: Any = None
        if bar and sys.stdout.isatty():
            self._open_bar()

    def _open_bar(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
        )
        self._bar.start()

    def start_shard(self, name: str, total: int | None) -> None:
        """A shard begins; ``total`` is its record count when known."""
        self.shard_name, self.shard_records, self.shard_total = name, 0, total
        if self._bar is not None:
            if self._task is not None:
                self._bar.remove_task(self._task)
            label = f"{name} ({self.shards_done + 1}/{self.shards} shards)"
            self._task = self._bar.add_task(label, total=total)

    def advance(self, records: int, errors: int) -> None:
        """Records (and errors among them) finished since the last call."""
        self.records += records
        self.errors += errors
        self.shard_records += records
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=records)
        if self.clock() - self._last_line >= self.interval_s:
            self._line()

    def finish_shard(self) -> None:
        """The current shard is committed."""
        self.shards_done += 1
        self._line()

    def rate(self) -> float:
        """Records per second since the start."""
        elapsed = self.clock() - self.started
        return self.records / elapsed if elapsed > 0 else 0.0

    def _line(self) -> None:
        self._last_line = self.clock()
        total = "?" if self.shard_total is None else str(self.shard_total)
        log.info(
            "progress: %d/%d shards done; %s %d/%s records; %d records, %d errors, %.1f records/s",
            self.shards_done,
            self.shards,
            self.shard_name,
            self.shard_records,
            total,
            self.records,
            self.errors,
            self.rate(),
        )

    def close(self) -> None:
        """Stop the bar, if any."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
