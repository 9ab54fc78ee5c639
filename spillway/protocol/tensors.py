"""Tensors on the wire: numpy arrays to and from Triton's binary layout and JSON data.

Little-endian, no padding; BOOL is one byte; each BYTES element is a 4-byte little-endian
length followed by its bytes. JSON data is row-major, flat or nested, and every element
must have the Python type its datatype allows (no silent coercion). A BYTES tensor whose
``parameters.content_type`` is ``"base64"`` carries each element's bytes base64-encoded in
its JSON string (``CONTENT_TYPE_BASE64``).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from spillway.protocol.datatypes import WIRE_DTYPES, datatype_of, numpy_dtype
from spillway.protocol.errors import InvalidInputError, NonFiniteInputError
from spillway.protocol.v2 import MAX_RANK

Buffer = bytes | bytearray | memoryview
Tensor = npt.NDArray[Any]

CONTENT_TYPE_BASE64 = "base64"
"""``parameters.content_type`` of a BYTES tensor whose JSON strings are the base64 (RFC 4648
section 4: the standard alphabet, padded) of its elements' bytes. V2 JSON carries a BYTES
element as a UTF-8 string, which an image file is not; this is how such an input travels
in JSON (an HTTP JSON body, a WebSocket text frame: API Gateway's WebSocket APIs take text
frames only). MLServer names the same convention ``base64`` (its ``Base64Codec``)."""

_LENGTH = struct.Struct("<I")
_INTS = frozenset({int})
# The Python types json.loads may produce for each datatype's elements.
_JSON_TYPES: dict[str, frozenset[type]] = {
    "BOOL": frozenset({bool}),
    **{f"{s}INT{b}": _INTS for s in ("", "U") for b in (8, 16, 32, 64)},
    **{f"FP{b}": frozenset({int, float}) for b in (16, 32, 64)},
    "BYTES": frozenset({str}),
}
_JSON_NAMES = {
    bool: "boolean",
    int: "integer",
    float: "floating-point",
    str: "string",
    dict: "object",
}


# --- tensors ------------------------------------------------------------------------------


def tensor_to_bytes(array: Tensor, datatype: str) -> bytes:
    """The binary-extension bytes of ``array``: little-endian, row-major, no padding; BOOL
    one byte each; BYTES as a 4-byte little-endian length then the bytes, per element."""
    return bytes(wire_buffer(np.asarray(array), datatype))


def tensor_from_bytes(raw: Buffer, datatype: str, shape: Sequence[int]) -> Tensor:
    """The array that ``raw`` (binary-extension bytes) encodes; sizes must match exactly."""
    dtype = numpy_dtype(datatype)
    if any(dim < 0 for dim in shape):
        raise InvalidInputError(f"shape {list(shape)} has a negative dimension")
    count = math.prod(shape)
    if datatype == "BYTES":
        return _split_bytes(memoryview(raw), count).reshape(shape)
    wire = WIRE_DTYPES[datatype]
    if len(raw) != count * wire.itemsize:
        raise InvalidInputError(
            f"{datatype} shape {list(shape)} needs {count * wire.itemsize} bytes, got {len(raw)}"
        )
    if datatype == "BOOL":  # any non-zero byte is true; never a bool holding 2
        return np.frombuffer(raw, dtype=np.uint8).astype(np.bool_).reshape(shape)
    array = np.frombuffer(raw, dtype=wire)
    if not array.flags.aligned:
        array = array.copy()
    return array.astype(dtype, copy=False).reshape(shape)


def _split_bytes(raw: memoryview, count: int) -> Tensor:
    if count * _LENGTH.size > len(raw):  # also keeps a huge shape from allocating
        raise InvalidInputError(f"BYTES data of {len(raw)} bytes cannot hold {count} elements")
    out = np.empty(count, dtype=np.object_)
    offset = 0
    for index in range(count):
        if offset + _LENGTH.size > len(raw):
            raise InvalidInputError(f"BYTES data ends before element {index}")
        (size,) = _LENGTH.unpack_from(raw, offset)
        offset += _LENGTH.size
        if offset + size > len(raw):
            raise InvalidInputError(f"BYTES element {index} is truncated")
        out[index] = raw[offset : offset + size].tobytes()
        offset += size
    if offset != len(raw):
        raise InvalidInputError(f"BYTES data has {len(raw) - offset} bytes after element {count}")
    return out


def wire_buffer(array: Tensor, datatype: str) -> Buffer:
    if datatype_of(array) != datatype:
        raise InvalidInputError(f"an array of dtype {array.dtype} cannot be sent as {datatype}")
    if datatype == "BYTES":
        parts: list[bytes] = []
        for item in array.reshape(-1).tolist():
            data = _element_bytes(item)
            parts += (_LENGTH.pack(len(data)), data)
        return b"".join(parts)
    contiguous = np.ascontiguousarray(array, dtype=WIRE_DTYPES[datatype])
    return contiguous.reshape(-1).view(np.uint8).data  # joined later without a copy


def _element_bytes(item: object) -> bytes:
    if isinstance(item, bytes | bytearray):
        return bytes(item)
    if isinstance(item, str):
        try:
            return item.encode()
        except UnicodeEncodeError:
            raise InvalidInputError("BYTES element is not valid Unicode") from None
    raise InvalidInputError(f"BYTES elements must be bytes or str, not {type(item).__name__}")


def base64_data(array: Tensor) -> list[str]:
    """A BYTES array's elements as JSON strings of base64 (``CONTENT_TYPE_BASE64``)."""
    return [base64.b64encode(_element_bytes(item)).decode() for item in array.reshape(-1).tolist()]


def json_data(array: Tensor, datatype: str) -> list[Any]:
    flat: list[Any] = array.reshape(-1).tolist()
    if datatype != "BYTES":
        return flat
    try:
        return [item if isinstance(item, str) else _element_bytes(item).decode() for item in flat]
    except UnicodeDecodeError:
        raise InvalidInputError("holds bytes that are not UTF-8; ask for binary data") from None


def is_base64(parameters: Mapping[str, Any] | None, datatype: str) -> bool:
    """Whether a tensor's ``parameters.content_type`` says its JSON strings are base64;
    other content types (MLServer's ``str``, ...) are read as before."""
    if (parameters or {}).get("content_type") != CONTENT_TYPE_BASE64:
        return False
    if datatype != "BYTES":
        raise InvalidInputError(
            f'content_type "{CONTENT_TYPE_BASE64}" is for BYTES data, not {datatype}'
        )
    return True


def from_json(
    data: Any, datatype: str, shape: Sequence[int], parameters: Mapping[str, Any] | None = None
) -> Tensor:
    """The array of a tensor's JSON ``data``; with ``content_type`` ``base64`` in its
    ``parameters``, each BYTES element is the bytes its string decodes to."""
    dtype = numpy_dtype(datatype)
    encoded = is_base64(parameters, datatype)
    if data is None:
        raise InvalidInputError("has neither data nor parameters.binary_data_size")
    flat, kinds = _flatten(data)
    count = math.prod(shape)
    if len(flat) != count:
        raise InvalidInputError(f"shape {list(shape)} needs {count} elements, data has {len(flat)}")
    if str in kinds and datatype.startswith("FP"):
        flat, kinds = _non_finite(flat, kinds)
    wrong = kinds - _JSON_TYPES[datatype]
    if wrong:
        found = ", ".join(sorted(_JSON_NAMES.get(kind, "null") for kind in wrong))
        raise InvalidInputError(f"{datatype} data may not hold {found} values")
    if datatype == "BYTES":
        out = np.empty(count, dtype=np.object_)
        out[:] = (
            [_from_base64(i, text) for i, text in enumerate(flat)]
            if encoded
            else [_element_bytes(text) for text in flat]
        )
        return out.reshape(shape)
    # A number too large for a floating-point datatype becomes infinite, as it does in a
    # gRPC client's fp32_contents or a binary tensor: the model's non-finite rule
    # (``check_finite``) then decides, the same on every door.
    try:
        with np.errstate(over="ignore" if datatype.startswith("FP") else "raise"):
            return np.array(flat, dtype=dtype).reshape(shape)
    except (OverflowError, FloatingPointError):
        raise InvalidInputError(f"data holds a value out of range for {datatype}") from None


def _from_base64(index: int, text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):  # ValueError: a character that is not ASCII
        raise InvalidInputError(
            f'element {index} is not base64 (content_type "{CONTENT_TYPE_BASE64}": the '
            "standard alphabet, padded, no whitespace)"
        ) from None


def check_finite(name: str, array: Tensor) -> None:
    """Refuse a floating-point input holding NaN or an infinity (``NonFiniteInputError``).
    Two reductions and no temporary array: ``max`` is NaN when any element is, and the
    extremes are infinite when any element is."""
    if array.size and not (np.isfinite(array.max()) and np.isfinite(array.min())):
        raise NonFiniteInputError(
            f"input {name!r} holds NaN or an infinity, which this model does not take "
            "(a model declares the inputs that may in spillway.non_finite_inputs)"
        )


def from_json_nested(data: Any, datatype: str) -> Tensor:
    """The array of nested JSON lists whose nesting is the shape (``[[1, 2], [3, 4]]`` is
    ``[2, 2]``, a bare value is a scalar); ragged lists are ``InvalidInputError``. Elements
    follow ``from_json``'s rules."""
    if data is None:
        raise InvalidInputError(f"{datatype} data may not hold null values")
    return from_json(data, datatype, nested_shape(data))


def nested_shape(data: Any) -> list[int]:
    """The shape of rectangular nested JSON lists; refuses ragged ones and any deeper than
    the protocol's ``MAX_RANK``."""
    shape: list[int] = []
    level = [data]
    while any(isinstance(item, list) for item in level):
        lengths = {len(item) if isinstance(item, list) else -1 for item in level}
        if len(lengths) != 1:
            raise InvalidInputError("data is not a rectangular array")
        if len(shape) == MAX_RANK:
            raise InvalidInputError(f"data has more than {MAX_RANK} dimensions")
        shape.append(lengths.pop())
        level = list(itertools.chain.from_iterable(level))
    return shape


def _flatten(data: Any) -> tuple[list[Any], set[type]]:
    """Row-major elements of flat or nested JSON lists, and the element types found."""
    flat = data if isinstance(data, list) else [data]
    kinds = set(map(type, flat))
    while list in kinds:
        if len(kinds) > 1:
            raise InvalidInputError("data mixes nested arrays with values")
        flat = list(itertools.chain.from_iterable(flat))
        kinds = set(map(type, flat))
    return flat, kinds


_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _non_finite(flat: list[Any], kinds: set[type]) -> tuple[list[Any], set[type]]:
    """JSON has no NaN or infinity: floating-point data may spell them as the strings
    ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (what Spillway writes); other strings
    stay errors."""
    values = [_NON_FINITE.get(x, x) if isinstance(x, str) else x for x in flat]
    return values, set(map(type, values))
