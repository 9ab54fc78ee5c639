"""Job records: JSON Lines input to tensors, outputs and errors back to JSON Lines.

An input line is ``{"id": "…", "data": {"<input>": <one row>}}``: one row of each input
without the batch dimension, as nested lists, or a string for a BYTES input. Values are
checked against the served datatype here (no bools as numbers, no silent overflow); names
and shapes are checked by the engine's ``prepare``. JSON is parsed with ``json.loads``
only; nothing is ever evaluated or unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from spillway.datatypes import numpy_dtype
from spillway.errors import InvalidInputError, SpillwayError
from spillway.modelconfig import TensorConfig
from spillway.processing import Tensors

MAX_ID_LENGTH = 256
_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}


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


class RecordInputError(InvalidInputError):
    """A record that cannot be read, with its id when the id itself was readable."""

    def __init__(self, message: str, record_id: str | None = None) -> None:
        super().__init__(message)
        self.record_id = record_id


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
        array = _bytes(value, spec) if spec.datatype == "BYTES" else _numeric(value, spec)
        tensors[name] = array[np.newaxis] if batch else array
    return tensors


def _numeric(value: Any, spec: TensorConfig) -> npt.NDArray[Any]:
    target = numpy_dtype(spec.datatype)
    try:
        array = np.asarray(value)
    except ValueError:
        raise InvalidInputError(f"input {spec.name!r} is not a rectangular array") from None
    if array.dtype.kind not in _KINDS[target.kind]:
        raise InvalidInputError(f"input {spec.name!r} must hold {spec.datatype} values")
    if target.kind in "iu" and array.size:
        info = np.iinfo(target.type)  # type: ignore[type-var]
        if array.min() < info.min or array.max() > info.max:
            raise InvalidInputError(f"input {spec.name!r} holds a value out of range")
    try:
        with np.errstate(over="raise", invalid="raise"):
            return array.astype(target, copy=False)
    except FloatingPointError:
        raise InvalidInputError(f"input {spec.name!r} holds a value out of range") from None


def _bytes(value: Any, spec: TensorConfig) -> npt.NDArray[Any]:
    if isinstance(value, str):  # a bare string fills a [1]-shaped (or [-1]) text input
        value = np.full((1,) * len(spec.dims), value, dtype=object).tolist()
    try:
        array = np.asarray(value)
    except ValueError:
        raise InvalidInputError(f"input {spec.name!r} is not a rectangular array") from None
    if array.dtype.kind != "U":
        raise InvalidInputError(f"input {spec.name!r} must hold strings")
    out = np.empty(array.size, dtype=np.object_)
    try:
        out[:] = [s.encode() for s in array.reshape(-1).tolist()]
    except UnicodeEncodeError:
        raise InvalidInputError(f"input {spec.name!r} is not valid Unicode") from None
    return out.reshape(array.shape)


def output_lines(ids: list[str], results: list[Tensors], batch: bool) -> list[str]:
    """``{"id", "outputs"}`` lines for a batch of records, each output row without the batch
    dimension. Converted per batch: numpy does the work once, not once per record."""
    if not results:
        return []
    join = np.concatenate if batch else np.stack
    values = {name: _json_rows(join([r[name] for r in results])) for name in results[0]}
    return [
        json.dumps({"id": record_id, "outputs": {n: v[i] for n, v in values.items()}})
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
