"""Job records: JSON Lines or a staged infer request in, outputs and errors out as JSON Lines.

An input line is ``{"id": "…", "data": {"<input>": <one row>}}``: one row of each input
without the batch dimension, as nested lists, or a string for a BYTES input. Values go
through the core's JSON tensor rules (``spillway.protocol.tensors``: strict per-datatype types, no
silent overflow); names and shapes are checked by the engine's ``prepare``. A staged
request (``spillway.protocol.messages.stage_request``) is a V2 infer body whose rows become records
``"0"``, ``"1"``…; an image object is one record whose id is its key, its bytes the
model's one BYTES input. JSON is parsed with ``json.loads`` only; nothing is ever evaluated or
unpickled. A line longer than the record limit is never held whole in memory, and a
repeated id is an error record: ids stay unique within a shard's outputs. Output lines
are strict JSON: non-finite floats are written as the strings ``"NaN"``, ``"Infinity"``
and ``"-Infinity"``, the core's policy (``spillway.protocol.codec``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt
import pydantic_core

from spillway.models.config import TensorConfig
from spillway.models.processing import Tensors
from spillway.protocol.codec import decode_request
from spillway.protocol.errors import (
    DuplicateIdError,
    InvalidInputError,
    PayloadTooLargeError,
    RecordInputError,
    SpillwayError,
)
from spillway.protocol.messages import read_staged_request
from spillway.protocol.tensors import from_json_nested

MAX_ID_LENGTH = 256
MAX_RECORD_BYTES = 1 << 20
"""Default longest JSON Lines record (``JOBS_MAX_RECORD_BYTES``)."""
_SKIP_CHUNK = 1 << 16  # bytes read at a time while skipping the rest of an over-long line

Parsed = tuple[str | None, int | None, "Tensors | SpillwayError"]
"""A record as read: its id (if readable), its place (line or row; ``None``: the whole
file) and its tensors, or why it has none."""


@dataclass(frozen=True)
class RecordError:
    """One line of a shard's errors file."""

    id: str | None
    error: str
    code: str
    line: int | None = None
    row: int | None = None

    @classmethod
    def of(cls, exc: SpillwayError, record_id: str | None, **where: int) -> RecordError:
        """The error line for a failed record."""
        return cls(record_id, exc.message, exc.code, **where)

    def to_json(self) -> str:
        """``{"id", "error", "code"}`` plus where the record was (``line`` or ``row``)."""
        body: dict[str, Any] = {"id": self.id, "error": self.error, "code": self.code}
        body.update({k: v for k, v in (("line", self.line), ("row", self.row)) if v is not None})
        return json.dumps(body, ensure_ascii=False)


def bounded_lines(source: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """Each line of ``source`` (with its newline), or ``None`` for a line over ``limit``
    bytes (newline excluded); at most ``limit + 1`` bytes of a line are held at a time."""
    while line := source.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while not line.endswith(b"\n") and (line := source.readline(_SKIP_CHUNK)):
            pass
        yield None


def split_record(raw: bytes) -> tuple[str, dict[str, Any]]:
    """The id and the ``data`` object of one input line."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise RecordInputError("the line is not valid JSON") from None
    if not isinstance(value, dict):
        raise RecordInputError("a record must be a JSON object")
    record_id = value.get("id")
    if not isinstance(record_id, str) or not 0 < len(record_id) <= MAX_ID_LENGTH:
        raise RecordInputError(f"a record needs an 'id' string of 1 to {MAX_ID_LENGTH} characters")
    data = value.get("data")
    if not isinstance(data, dict):
        raise RecordInputError("a record needs a 'data' object", record_id)
    return record_id, data


def to_tensors(data: Mapping[str, Any], specs: Mapping[str, TensorConfig], batch: bool) -> Tensors:
    """One request's tensors from a record's ``data`` (with a batch dimension of 1)."""
    tensors: Tensors = {}
    for name, value in data.items():
        spec = specs.get(name)
        if spec is None:
            raise InvalidInputError(f"unknown input {str(name)[:100]!r}")
        if spec.datatype == "BYTES" and isinstance(value, str):
            # A bare string fills a [1]-shaped (or [-1]) text input.
            value = np.full((1,) * len(spec.dims), value, dtype=object).tolist()
        try:
            array = from_json_nested(value, spec.datatype)
        except InvalidInputError as exc:
            raise InvalidInputError(f"input {name!r}: {exc.message}") from None
        tensors[name] = array[np.newaxis] if batch else array
    return tensors


def jsonl_records(
    source: BinaryIO,
    specs: Mapping[str, TensorConfig],
    batch: bool,
    max_record_bytes: int = MAX_RECORD_BYTES,
) -> Iterator[Parsed]:
    """Every record of a JSON Lines file, by line number; blank lines are no records, a
    line over ``max_record_bytes`` is a ``payload_too_large`` error record."""
    for number, raw in enumerate(bounded_lines(source, max_record_bytes), 1):
        if raw is None:
            message = f"line {number} is longer than the limit of {max_record_bytes} bytes"
            yield None, number, PayloadTooLargeError(message)
            continue
        if not raw.strip():
            continue
        record_id: str | None = None
        parsed: Tensors | SpillwayError
        try:
            record_id, data = split_record(raw)
            parsed = to_tensors(data, specs, batch)
        except RecordInputError as exc:
            record_id, parsed = exc.record_id, exc
        except SpillwayError as exc:
            parsed = exc
        yield record_id, number, parsed


def unique_ids(records: Iterable[Parsed]) -> Iterator[Parsed]:
    """``records`` with each repeated id turned into a ``duplicate_id`` error: only the
    first record with an id runs (whether it succeeds or not)."""
    seen: set[str] = set()
    for record_id, place, parsed in records:
        if record_id is not None:
            if record_id in seen:
                message = f"record id {record_id!r} is used by an earlier record"
                parsed = DuplicateIdError(message)
            seen.add(record_id)
        yield record_id, place, parsed


def staged_records(data: bytes, batch: bool) -> Iterator[Parsed]:
    """One record per row (first dimension) of a staged infer request, with ids ``"0"``,
    ``"1"``…; without batching the request is one record. A request that cannot be
    decoded is one failed record."""
    try:
        body, header_length = read_staged_request(data)
        arrays = decode_request(body, header_length)[1]
        rows = _rows(arrays) if batch else 1
    except SpillwayError as exc:
        yield None, None, exc
        return
    if not batch:
        yield "0", 0, arrays
        return
    for row in range(rows):
        yield str(row), row, {name: array[row : row + 1] for name, array in arrays.items()}


def image_input(specs: Sequence[TensorConfig]) -> TensorConfig:
    """The input an image object fills: a model's one input, of datatype BYTES."""
    if len(specs) != 1 or specs[0].datatype != "BYTES":
        found = ", ".join(f"{t.name} {t.datatype}" for t in specs)
        raise InvalidInputError(f"images need a model with one BYTES input; it has {found}")
    return specs[0]


def image_records(
    images: Iterable[tuple[str, Path | None, int]],
    spec: TensorConfig,
    batch: bool,
    max_record_bytes: int = MAX_RECORD_BYTES,
) -> Iterator[Parsed]:
    """One record per image ``(key, file, size)`` with the key as its id; an image over
    ``max_record_bytes`` (never downloaded: no file) is a ``payload_too_large`` error."""
    for key, path, size in images:
        if path is None or size > max_record_bytes:
            message = f"the image is {size} bytes, over the limit of {max_record_bytes} bytes"
            yield key, None, PayloadTooLargeError(message)
            continue
        array = np.empty((1,) * len(spec.dims), dtype=np.object_)
        array.flat[0] = path.read_bytes()
        yield key, None, {spec.name: array[np.newaxis] if batch else array}


def _rows(arrays: Tensors) -> int:
    counts = {array.shape[0] if array.ndim else -1 for array in arrays.values()}
    if -1 in counts:
        raise InvalidInputError("every input needs a batch dimension")
    if len(counts) != 1:
        raise InvalidInputError("all inputs must have the same batch size")
    return counts.pop()


def output_lines(ids: list[str], results: list[Tensors], batch: bool) -> list[str]:
    """``{"id", "outputs"}`` lines for a batch of records, each output row without the batch
    dimension. Converted per batch: numpy does the work once, not once per record."""
    if not results:
        return []
    join = np.concatenate if batch else np.stack
    values = {name: _json_rows(join([r[name] for r in results])) for name in results[0]}
    return [
        pydantic_core.to_json(
            {"id": record_id, "outputs": {n: v[i] for n, v in values.items()}},
            inf_nan_mode="strings",
        ).decode()
        for i, record_id in enumerate(ids)
    ]


def _json_rows(array: npt.NDArray[Any]) -> list[Any]:
    if array.dtype == np.object_:
        flat = [x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in array.flat]
        rows: list[Any] = np.array(flat, dtype=object).reshape(array.shape).tolist()
        return rows
    if array.dtype == np.float32:
        return shortest_float32(array).tolist()  # type: ignore[no-any-return]
    return array.tolist()  # type: ignore[no-any-return]


def shortest_float32(array: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """Float64 values whose ``repr`` is the shortest decimal that reads back as exactly the
    same float32: ``0.1f`` is written ``0.1``, not ``0.10000000149011612``. Half the bytes
    and half the ``json.dumps`` time; every value is checked to round-trip."""
    values = array.astype(np.float64)
    result = values.copy()  # fallback: the exact double of each float32
    todo = np.isfinite(values) & (values != 0)
    magnitude = np.floor(np.log10(np.abs(np.where(todo, values, 1.0))))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for digits in (6, 7, 8, 9):
            if not todo.any():
                break
            # Scale by an exact power of ten (up to 1e22) on the side that keeps it exact.
            shift = digits - 1 - magnitude
            power = 10.0 ** np.abs(shift)
            up = shift >= 0
            rounded = np.round(np.where(up, values * power, values / power))
            candidate = np.where(up, rounded / power, rounded * power)
            exact = todo & (candidate.astype(np.float32) == array)
            result[exact] = candidate[exact]
            todo &= ~exact
    return result
