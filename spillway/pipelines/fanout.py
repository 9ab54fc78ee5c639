"""Fan-out and fan-in: a step run over the rows of a variable-length tensor.

A step with ``spillway.map`` (``spillway.models.pipeline_schema.StepMap``) runs over
rows: each of a request's B items owns ``counts[i]`` rows of the tensors it maps over (an
OCR detector's N crops per image), the step model gets them as rows of its own, and its
outputs come back per item, in order. The layout of the tensors mapped over is the
pipeline's, and the outputs take the same one:

* a pipeline that does not batch (``max_batch_size`` 0) owns its tensors' first
  dimension, so the rows are **flat**: the tensor's leading dimension is the sum of the
  counts, item 0's rows first; each output is flat too, ``[sum(counts), ...]``, and the
  same counts tensor says whose rows are whose.
* a pipeline that batches gives every tensor one row per item (the batcher splits each
  step model's outputs by request rows), so the rows are **padded**: ``[B, K, ...]``,
  item i's rows the first ``counts[i]`` of its K slots; each output is ``[B, K, ...]``,
  the unused slots zero (empty bytes for BYTES).

Counts are INT32 or INT64, ``[B]`` or ``[B, 1]``. A request whose counts sum past the
step's ``max_rows`` is refused (413 ``fanout_too_large``) before a row is cut out or
run: what a fan-out may cost is bounded per request before it runs, on every runtime
(they all spread rows here). An item with no rows gets none back;
a request whose items have no rows calls no model. The step model batches rows in
chunks of at most its ``max_batch_size`` (on a server, each chunk is a request of the
step model's batcher, so rows of concurrent requests batch together); a step model
that does not batch gets the rows one by one, each as its input takes it (with a
leading dimension of one, or without one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from spillway.models.pipeline_schema import DEFAULT_MAX_ROWS
from spillway.models.processing import Tensors
from spillway.protocol.datatypes import numpy_dtype
from spillway.protocol.errors import (
    FanOutTooLargeError,
    InferenceError,
    InvalidInputError,
    SpillwayError,
)

COUNT_TYPES = frozenset({"INT32", "INT64"})


@dataclass(frozen=True)
class FanOut:
    """How a mapped step spreads a request over rows and gathers them back (checked
    at load by ``spillway.pipelines.graph``)."""

    inputs: Mapping[str, str]
    """The step model's inputs and the pipeline tensors whose rows feed them."""
    counts: str
    """The pipeline tensor holding each item's row count."""
    padded: bool
    """``[B, K, ...]`` per request (the pipeline batches); else flat ``[sum, ...]``."""
    chunk: int
    """Rows per model input: its ``max_batch_size``, 1 when it does not batch."""
    lead: bool
    """A row goes with a leading dimension of one (a model that batches, or one whose
    input has that dimension); else as it is."""
    outputs: Mapping[str, tuple[str, tuple[int, ...]]]
    """Each output of the step model: its datatype and the dims of one row."""
    caller: bool
    """The counts and the rows come from the request itself: wrong counts are the
    caller's error (400), else a step model's (500)."""
    max_rows: int = DEFAULT_MAX_ROWS
    """The most rows one request may run through the step (``StepMap.max_rows``)."""
    where: str = "the mapped step"
    """The step and its pipeline, as a refusal names them."""

    def fail(self, reason: str) -> SpillwayError:
        return (InvalidInputError if self.caller else InferenceError)(reason)


@dataclass(frozen=True)
class Spread:
    """One request's rows: its per-item counts, one unit of model input per row, and
    the slots per item of a padded layout."""

    counts: list[int]
    units: list[Tensors]
    slots: int


def spread(fan: FanOut, state: Tensors) -> Spread:
    """The rows of one request's pipeline tensors, item by item, in order."""
    raw = np.asarray(state[fan.counts])
    if raw.ndim not in (1, 2) or (raw.ndim == 2 and raw.shape[1] != 1):
        raise fan.fail(f"counts {fan.counts!r} must be [items] or [items, 1], got {raw.shape}")
    counts = [int(c) for c in raw.reshape(-1)]
    if any(c < 0 for c in counts):
        raise fan.fail(f"counts {fan.counts!r} holds a negative count")
    if sum(counts) > fan.max_rows:  # before any row is cut out, let alone run
        raise FanOutTooLargeError(
            f"{fan.where} would run {sum(counts)} rows for this request; it allows at "
            f"most {fan.max_rows} per request"
        )
    rows = {m: _rows(fan, counts, t, np.asarray(state[t])) for m, t in fan.inputs.items()}
    first = np.asarray(state[next(iter(fan.inputs.values()))])
    slots = int(first.shape[1]) if fan.padded else 0
    units = [
        {m: a[j : j + 1] if fan.lead else a[j] for m, a in rows.items()} for j in range(sum(counts))
    ]
    return Spread(counts, units, slots)


def _rows(fan: FanOut, counts: list[int], name: str, array: np.ndarray) -> np.ndarray:
    """A request's rows of one tensor, ``[sum(counts), ...]``."""
    if not fan.padded:
        if array.shape[0] != sum(counts):
            raise fan.fail(
                f"{name!r} has {array.shape[0]} rows but counts {fan.counts!r} sum to {sum(counts)}"
            )
        return array
    if array.ndim < 2 or array.shape[0] != len(counts):
        raise fan.fail(f"{name!r} must be [{len(counts)}, slots, ...], got {list(array.shape)}")
    if counts and max(counts) > array.shape[1]:
        raise fan.fail(
            f"counts {fan.counts!r} name {max(counts)} rows but {name!r} has "
            f"{array.shape[1]} slots per item"
        )
    return np.concatenate([array[i, :c] for i, c in enumerate(counts)], axis=0)


def chunks(fan: FanOut, units: Sequence[Tensors]) -> list[Tensors]:
    """Rows grouped into the step model's inputs: at most ``chunk`` rows each."""
    if not fan.lead or fan.chunk == 1:
        return list(units)
    return [
        {m: np.concatenate([u[m] for u in units[s : s + fan.chunk]]) for m in fan.inputs}
        for s in range(0, len(units), fan.chunk)
    ]


def split(fan: FanOut, calls: Sequence[Tensors], answers: Sequence[Tensors]) -> list[Tensors]:
    """The step model's answers to ``chunks`` back as one output dict per row, each
    output with a leading dimension of one."""
    if len(answers) != len(calls):
        raise InferenceError(f"{len(calls)} chunks of rows got {len(answers)} answers")
    rows: list[Tensors] = []
    for call, answer in zip(calls, answers, strict=True):
        size = len(next(iter(call.values()))) if fan.lead else 1
        for name in fan.outputs:
            array = np.asarray(answer[name]) if fan.lead else np.asarray(answer[name])[None]
            if array.shape[:1] != (size,):
                raise InferenceError(f"output {name!r} has {array.shape[:1]} rows, not {size}")
        for j in range(size):
            rows.append({n: _row(fan, answer[n], j) for n in fan.outputs})
    return rows


def _row(fan: FanOut, array: np.ndarray, j: int) -> np.ndarray:
    return np.asarray(array)[j : j + 1] if fan.lead else np.asarray(array)[None]


def gather(fan: FanOut, rows: Spread, results: Sequence[Tensors]) -> Tensors:
    """The fan-in: each output's rows per item, in order, laid out as the rows came."""
    gathered: Tensors = {}
    for name, (datatype, dims) in fan.outputs.items():
        parts = [r[name] for r in results]
        shape = parts[0].shape[1:] if parts else tuple(max(d, 0) for d in dims)
        try:
            flat = np.concatenate(parts) if parts else np.empty((0, *shape), numpy_dtype(datatype))
        except ValueError as error:
            raise InferenceError(f"rows of output {name!r} differ in shape: {error}") from error
        gathered[name] = _padded(flat, rows) if fan.padded else flat
    return gathered


def _padded(flat: np.ndarray, rows: Spread) -> np.ndarray:
    """``[B, slots, ...]``: item i's rows first in its slots, the others zero."""
    out = np.zeros((len(rows.counts), rows.slots, *flat.shape[1:]), dtype=flat.dtype)
    if flat.dtype == np.object_:
        out.fill(b"")
    start = 0
    for i, count in enumerate(rows.counts):
        out[i, :count] = flat[start : start + count]
        start += count
    return out
