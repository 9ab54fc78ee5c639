"""KServe V2 gRPC messages to the core's requests and back, converted once.

A ``ModelInferRequest`` becomes the core's decoded request (``spillway.inference.Decoded``):
its header is validated as a JSON one is, each input read from its raw contents (without
a copy) or its typed contents, and every output asked for as binary data. The encoded
response's JSON header gives a ``ModelInferResponse`` its fields, and the bytes after it
are the raw output contents as they are. Triton's other JSON documents (metadata, config,
statistics, the repository index) become their messages by ``parsed``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2

from spillway import inference
from spillway.models.processing import Tensors
from spillway.protocol.codec import request_from_header
from spillway.protocol.datatypes import numpy_dtype
from spillway.protocol.errors import InvalidInputError
from spillway.protocol.framing import read_json_header
from spillway.protocol.tensors import tensor_from_bytes
from spillway.protocol.wire import InferParameters

_CONTENTS = {
    "BOOL": "bool_contents",
    **{f"INT{b}": "int_contents" for b in (8, 16, 32)},
    "INT64": "int64_contents",
    **{f"UINT{b}": "uint_contents" for b in (8, 16, 32)},
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
"""The ``InferTensorContents`` field of each datatype that has one (FP16 and BF16 come
only as raw contents)."""


def _parameter(value: Any) -> Any:
    """An ``InferParameter``'s value (``None`` when none is set)."""
    kind = value.WhichOneof("parameter_choice")
    return None if kind is None else getattr(value, kind)


def _set_parameter(target: Any, value: Any) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = str(value)


def decode_request(request: Any) -> inference.Decoded:
    """A ``ModelInferRequest`` as the core's decoded request: its header validated as a
    JSON one is, each input read from its raw contents (without a copy) or typed
    contents, every output asked for as binary data."""
    parameters = {key: _parameter(value) for key, value in request.parameters.items()}
    parameters["binary_data_output"] = True
    header: dict[str, Any] = {
        "inputs": [
            {"name": t.name, "shape": list(t.shape), "datatype": t.datatype} for t in request.inputs
        ],
        "parameters": parameters,
    }
    if request.id:
        header["id"] = request.id
    if request.outputs:
        header["outputs"] = [
            {"name": o.name, "parameters": {"binary_data": True}} for o in request.outputs
        ]
    parsed = request_from_header(header)
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInputError(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs; "
            "give every input its raw contents or none"
        )
    arrays: Tensors = {}
    for index, (tensor, message) in enumerate(zip(parsed.inputs, request.inputs, strict=True)):
        try:
            if raw:
                arrays[tensor.name] = tensor_from_bytes(raw[index], tensor.datatype, tensor.shape)
            else:
                arrays[tensor.name] = _typed(message.contents, tensor.datatype, tensor.shape)
        except InvalidInputError as error:
            raise type(error)(f"input {tensor.name!r}: {error.message}") from None
    return inference.Decoded(parsed, arrays, InferParameters.of(parsed.parameters))


def _typed(contents: Any, datatype: str, shape: list[int]) -> np.ndarray[Any, Any]:
    field = _CONTENTS.get(datatype)
    if field is None:
        raise InvalidInputError(f"{datatype} data comes only as raw_input_contents")
    values = getattr(contents, field)
    count = int(np.prod(shape))
    if len(values) != count:
        raise InvalidInputError(f"shape {shape} needs {count} elements, data has {len(values)}")
    if datatype == "BYTES":
        out = np.empty(count, dtype=np.object_)
        out[:] = list(values)
        return out.reshape(shape)
    try:
        with np.errstate(over="raise"):
            return np.array(values, dtype=numpy_dtype(datatype)).reshape(shape)
    except (OverflowError, FloatingPointError):
        raise InvalidInputError(f"data holds a value out of range for {datatype}") from None


def encode_response(body: bytes, header_length: int | None) -> Any:
    """A ``ModelInferResponse`` from the encoded response (all of whose outputs are
    binary): the JSON header's fields, and the bytes after it as the raw contents."""
    header = read_json_header(body, header_length)
    response = service_pb2.ModelInferResponse(
        model_name=header["model_name"],
        model_version=header.get("model_version", ""),
        id=header.get("id", ""),
    )
    for key, value in (header.get("parameters") or {}).items():
        _set_parameter(response.parameters[key], value)
    offset = header_length or len(body)
    view = memoryview(body)
    for output in header.get("outputs", []):
        response.outputs.add(
            name=output["name"], datatype=output["datatype"], shape=output["shape"]
        )
        size = output["parameters"]["binary_data_size"]
        response.raw_output_contents.append(bytes(view[offset : offset + size]))
        offset += size
    return response


def parsed(value: Any, message: Any) -> Any:
    """A document of the HTTP side (Triton's JSON, whose names are the messages' own)
    as ``message``; fields only the JSON has are left out."""
    return json_format.ParseDict(value, message, ignore_unknown_fields=True)
