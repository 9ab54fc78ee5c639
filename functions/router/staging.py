"""An infer request as batch-job input records, without numpy.

The jobs API reads JSON Lines records, one row each: ``{"id": "<request id>-<row>",
"data": {"<input>": <the row, nested lists without the batch dimension>}}``. Rows come
from the request's JSON ``data`` or from its binary tensor bytes (decoded with
``struct``); every input must have the same number of rows (its first dimension).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from spillway.errors import InvalidInputError

_FORMATS = {
    "BOOL": "?",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}
_LENGTH = struct.Struct("<I")


def records(header: dict[str, Any], binary: bytes, request_id: str) -> list[str]:
    """The request's rows as JSON Lines records (``binary``: the bytes after the header)."""
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInputError("a batch request needs inputs")
    columns: dict[str, list[Any]] = {}
    offset = 0
    for tensor in inputs:
        name, shape, flat, offset = _tensor(tensor, binary, offset)
        if not shape:
            raise InvalidInputError(f"input {name!r} has no batch dimension")
        columns[name] = _rows(flat, shape)
    if offset != len(binary):
        raise InvalidInputError(f"{len(binary) - offset} bytes follow the last binary tensor")
    counts = {len(rows) for rows in columns.values()}
    if len(counts) != 1:
        raise InvalidInputError("all inputs must have the same number of rows")
    return [
        json.dumps({"id": f"{request_id}-{i}", "data": {n: rows[i] for n, rows in columns.items()}})
        for i in range(counts.pop())
    ]


def _tensor(tensor: Any, binary: bytes, offset: int) -> tuple[str, list[int], list[Any], int]:
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise InvalidInputError("each input needs a name")
    name, shape, datatype = tensor["name"], tensor.get("shape"), tensor.get("datatype")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape
    ):
        raise InvalidInputError(f"input {name!r} has an invalid shape")
    if datatype != "BYTES" and datatype not in _FORMATS:
        raise InvalidInputError(f"input {name!r} has an unsupported datatype")
    count = math.prod(shape)
    size = (tensor.get("parameters") or {}).get("binary_data_size")
    if size is None:
        flat = _flatten(tensor.get("data"))
    elif not isinstance(size, int) or isinstance(size, bool) or offset + size > len(binary):
        raise InvalidInputError(f"input {name!r} has an invalid binary_data_size")
    else:
        flat = _decode(binary[offset : offset + size], datatype, count, name)
        offset += size
    if len(flat) != count:
        raise InvalidInputError(f"input {name!r}: shape {shape} needs {count} elements")
    return name, shape, flat, offset


def _flatten(data: Any) -> list[Any]:
    if data is None:
        raise InvalidInputError("an input has neither data nor binary_data_size")
    flat, stack = [], [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            flat.append(item)
    return flat


def _decode(raw: bytes, datatype: str, count: int, name: str) -> list[Any]:
    if datatype != "BYTES":
        fmt = struct.Struct(f"<{count}{_FORMATS[datatype]}")
        if fmt.size != len(raw):
            raise InvalidInputError(f"input {name!r}: {len(raw)} bytes do not fit its shape")
        return list(fmt.unpack(raw))
    texts, offset = [], 0
    for _ in range(count):
        if offset + _LENGTH.size > len(raw):
            raise InvalidInputError(f"input {name!r}: BYTES data ends early")
        (size,) = _LENGTH.unpack_from(raw, offset)
        offset += _LENGTH.size
        try:
            texts.append(raw[offset : offset + size].decode())
        except UnicodeDecodeError:
            raise InvalidInputError(f"input {name!r} holds text that is not UTF-8") from None
        offset += size
    if offset != len(raw):
        raise InvalidInputError(f"input {name!r}: BYTES data is longer than its shape")
    return texts


def _rows(flat: list[Any], shape: list[int]) -> list[Any]:
    inner = shape[1:]
    width = math.prod(inner)
    return [_nest(flat[i * width : (i + 1) * width], inner) for i in range(shape[0])]


def _nest(flat: list[Any], dims: list[int]) -> Any:
    if not dims:
        return flat[0]
    if len(dims) == 1:
        return flat
    width = math.prod(dims[1:])
    return [_nest(flat[i * width : (i + 1) * width], dims[1:]) for i in range(dims[0])]
