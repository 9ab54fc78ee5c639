"""What running a shard needs whatever its format: the model contract, counts, isolation.

A record that fails validation goes to the errors file and never joins a batch. Prepared
records run in batches (``OnnxModel.run``); when a whole batch fails, its records run one
by one so the failure lands on the record that causes it. ``records == outputs + errors``
holds for every finished shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from spillway.models.config import ModelConfig
from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import SpillwayError

log = logging.getLogger("spillway.jobs.shard")

OnBatch = Callable[[int, int], None]
"""Called after each batch with the records and errors finished since the last call."""


class JobModel(Protocol):
    """What an offline job's shard needs of a model: ``OnnxModel`` is one. (The job runs
    on AWS Batch; the model's ``batching`` is the engine's batch dimension.)"""

    name: str
    version: int
    config: ModelConfig

    @property
    def batching(self) -> bool:
        """Whether tensors carry a leading batch dimension."""

    def prepare(self, inputs: Tensors) -> Prepared:
        """Validate and pre-process one request."""

    def prepare_many(self, requests: Sequence[Tensors]) -> list[Prepared | SpillwayError]:
        """``prepare`` over several requests in one call; each request's error is its own."""

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        """One run over prepared requests; one output per request, in order."""


@dataclass
class ShardCounts:
    """What a shard run did."""

    records: int = 0
    outputs: int = 0
    errors: int = 0
    batches: int = 0
    batch_failures: int = 0


def run_isolated(
    model: JobModel, batch: list[Prepared]
) -> tuple[list[Tensors | SpillwayError], bool]:
    """Outputs (or the error) of each request, and whether the whole batch failed and was
    retried one request at a time."""
    try:
        return list(model.run(batch)), False
    except SpillwayError as exc:
        if len(batch) == 1:
            return [exc], True
        log.warning("batch of %d failed (%s); retrying record by record", len(batch), exc)
    results: list[Tensors | SpillwayError] = []
    for prepared in batch:
        try:
            results.append(model.run([prepared])[0])
        except SpillwayError as exc:
            results.append(exc)
    return results, True


def count_records(path: Path, fmt: str) -> int | None:
    """Records in an input file for the progress total (lines, or rows), if cheap to know."""
    if fmt == "staged":  # its rows are known only once the request is decoded
        return None
    if fmt == "npy":
        try:
            return int(np.load(path, mmap_mode="r", allow_pickle=False).shape[0])
        except (ValueError, OSError, IndexError):
            return None
    with path.open("rb") as handle:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))


class Tally:
    """A shard's counts plus the progress callback, reported after each batch."""

    def __init__(self, on_batch: OnBatch) -> None:
        self.counts = ShardCounts()
        self._on_batch = on_batch
        self._reported = (0, 0)

    def report(self) -> None:
        """Tell the callback what finished (in outputs or errors) since the last report."""
        done = (self.counts.outputs + self.counts.errors, self.counts.errors)
        self._on_batch(done[0] - self._reported[0], done[1] - self._reported[1])
        self._reported = done
