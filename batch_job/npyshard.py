"""Running one ``.npy`` shard: rows in chunks of the batch size, bad rows isolated.

Outputs are plain ``.npy`` files (memory-mappable, written without a copy): one per model
output, ``<shard>.out-<output>.npy``, plus ``<shard>.rows.npy``, the input row of each
output row, so rows that failed leave no gap. The array is validated a chunk at a time
(dtype and shape are properties of the whole array, so a bad array fails every row
alike); a chunk whose run fails is rerun row by row. Inputs are read with
``allow_pickle=False``: an object array is refused, never unpickled.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from batch_job.records import RecordError
from batch_job.shard import JobModel, OnBatch, ShardCounts, Tally
from spillway.models.processing import Tensors
from spillway.protocol.datatypes import numpy_dtype
from spillway.protocol.errors import InvalidInputError, SpillwayError

log = logging.getLogger("spillway.jobs.shard")

ROWS_SUFFIX = ".rows.npy"
_SAFE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")


def output_suffix(name: str, index: int) -> str:
    """``.out-<output>.npy``; an output name unfit for a key is replaced by its index."""
    return f".out-{name if _SAFE.fullmatch(name) else index}.npy"


class _Outputs:
    """The runs' output arrays, kept as they came and written one after the other under
    a single ``.npy`` header: no concatenation copy. Failed rows are simply not there."""

    def __init__(self, model: JobModel) -> None:
        self.specs = model.config.output
        self.rows: list[npt.NDArray[np.int64]] = []
        self.parts: dict[str, list[npt.NDArray[Any]]] = {o.name: [] for o in self.specs}

    def keep(self, first: int, result: Tensors) -> int:
        count = len(next(iter(result.values())))
        self.rows.append(np.arange(first, first + count, dtype=np.int64))
        for name, array in result.items():
            self.parts[name].append(array)
        return count

    def save(self, stem: Path) -> None:
        rows = np.concatenate(self.rows) if self.rows else np.empty(0, dtype=np.int64)
        np.save(stem.with_name(stem.name + ROWS_SUFFIX), rows, allow_pickle=False)
        for index, spec in enumerate(self.specs):
            path = stem.with_name(stem.name + output_suffix(spec.name, index))
            parts = self.parts[spec.name]
            if not parts:
                shape = (0, *(max(d, 0) for d in spec.dims))
                np.save(path, np.empty(shape, dtype=numpy_dtype(spec.datatype)))
            elif parts[0].dtype == np.object_:  # text as unicode: never needs pickle
                text = np.vectorize(_text, otypes=[np.str_])(np.concatenate(parts))
                np.save(path, text, allow_pickle=False)
            else:
                _save_parts(path, parts)


def _save_parts(path: Path, parts: list[npt.NDArray[Any]]) -> None:
    """One ``.npy`` of the parts stacked along the first axis, written part by part."""
    first = np.ascontiguousarray(parts[0])
    header = np.lib.format.header_data_from_array_1_0(first)
    header["shape"] = (sum(len(p) for p in parts), *first.shape[1:])
    with path.open("wb") as handle:
        np.lib.format.write_array_header_2_0(handle, header)
        for part in parts:
            np.ascontiguousarray(part, dtype=first.dtype).tofile(handle)


def process_npy(
    model: JobModel,
    source: Path,
    stem: Path,
    errors: TextIO,
    batch_size: int,
    on_batch: OnBatch,
) -> ShardCounts:
    """Run every row of a ``.npy`` array in chunks of ``batch_size`` rows; outputs go to
    ``<stem>.rows.npy`` and ``<stem>.out-<output>.npy``."""
    tally = Tally(on_batch)

    def fail(first: int, count: int, exc: SpillwayError) -> None:
        for row in range(first, first + count):
            errors.write(RecordError.of(exc, str(row), row=row).to_json() + "\n")
        tally.counts.errors += count

    try:
        name, array = _open_npy(model, source)
    except SpillwayError as exc:
        tally.counts.records = tally.counts.errors = 1  # the file is one failed record
        errors.write(RecordError.of(exc, None).to_json() + "\n")
        tally.report()
        _Outputs(model).save(stem)
        return tally.counts
    outputs = _Outputs(model)
    target = numpy_dtype(next(t.datatype for t in model.config.input))
    for first in range(0, len(array), batch_size):
        chunk = np.ascontiguousarray(array[first : first + batch_size], dtype=target)
        tally.counts.records += len(chunk)
        tally.counts.batches += 1
        try:
            prepared = model.prepare({name: chunk})
        except SpillwayError as exc:
            fail(first, len(chunk), exc)
            tally.report()
            continue
        try:
            tally.counts.outputs += outputs.keep(first, model.run([prepared])[0])
        except SpillwayError as exc:
            log.warning("chunk at row %d failed (%s); retrying row by row", first, exc)
            tally.counts.batch_failures += 1
            for row in range(first, first + len(chunk)):
                try:
                    result = model.run([model.prepare({name: chunk[row - first :][:1]})])[0]
                    tally.counts.outputs += outputs.keep(row, result)
                except SpillwayError as row_exc:
                    fail(row, 1, row_exc)
        tally.report()
    outputs.save(stem)
    return tally.counts


def _open_npy(model: JobModel, source: Path) -> tuple[str, npt.NDArray[Any]]:
    inputs = model.config.input
    if len(inputs) != 1 or inputs[0].datatype == "BYTES" or not model.batching:
        raise InvalidInputError(".npy input needs a batching model with one numeric input")
    try:
        # Mapped, not read: chunks are views of the page cache, and a shard larger than
        # memory still runs.
        array = np.load(source, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InvalidInputError(f"not a readable .npy array: {exc}") from None
    target = numpy_dtype(inputs[0].datatype)
    if array.ndim < 1 or not np.can_cast(array.dtype, target, "same_kind"):
        raise InvalidInputError(
            f"a {array.dtype} array of shape {list(array.shape)} cannot feed "
            f"{inputs[0].datatype} input {inputs[0].name!r}"
        )
    return inputs[0].name, array


def _text(item: object) -> str:
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
