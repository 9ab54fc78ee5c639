"""Datatype tables: Open Inference Protocol names, numpy dtypes, Triton and ONNX names."""

from __future__ import annotations

from typing import Final, Literal

import numpy as np

from spillway.protocol.errors import UnsupportedDatatypeError

Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]

# BYTES tensors are numpy object arrays whose elements are ``bytes``.
NUMPY_DTYPES: Final[dict[str, np.dtype[np.generic]]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}

# Little-endian wire dtypes for the binary tensor extension.
WIRE_DTYPES: Final[dict[str, np.dtype[np.generic]]] = {
    name: dt.newbyteorder("<") for name, dt in NUMPY_DTYPES.items() if name != "BYTES"
}

ONNX_TYPES: Final[dict[str, str]] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def numpy_dtype(datatype: str) -> np.dtype[np.generic]:
    """The numpy dtype for a V2 datatype name; unknown names are a client error."""
    try:
        return NUMPY_DTYPES[datatype]
    except KeyError:
        raise UnsupportedDatatypeError(f"unknown datatype {datatype!r}") from None


_BY_DTYPE: Final[dict[np.dtype[np.generic], str]] = {dt: name for name, dt in NUMPY_DTYPES.items()}


def datatype_of(array: np.ndarray) -> str:
    """The V2 datatype name for a numpy array."""
    name = _BY_DTYPE.get(array.dtype)  # native byte order: one look-up on every request
    if name is not None:
        return name
    if array.dtype == np.object_ or array.dtype.kind in ("S", "U"):
        return "BYTES"
    for name, dt in NUMPY_DTYPES.items():
        if dt == array.dtype:
            return name
    raise UnsupportedDatatypeError(f"numpy dtype {array.dtype} has no V2 datatype")


def from_triton_type(name: str) -> str:
    """The V2 datatype for a Triton ``TYPE_*`` name."""
    if name == "TYPE_STRING":
        return "BYTES"
    if not name.startswith("TYPE_"):
        raise UnsupportedDatatypeError(f"unknown Triton data_type {name!r}")
    datatype = name.removeprefix("TYPE_")
    numpy_dtype(datatype)
    return datatype


def from_onnx_type(name: str) -> str:
    """The V2 datatype for an ONNX Runtime type string such as ``tensor(float)``."""
    try:
        return ONNX_TYPES[name]
    except KeyError:
        raise UnsupportedDatatypeError(f"unsupported ONNX type {name!r}") from None
