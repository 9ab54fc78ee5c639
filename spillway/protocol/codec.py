"""Inference bodies to numpy arrays and back: JSON tensors and Triton's binary extension.

Pure functions over ``bytes``: the GPU service and the CPU Lambda use ``decode_request`` and
``encode_response``; clients (the router, the batch job, tests) use ``encode_request`` and
``decode_response``. A binary body is the JSON header followed by each binary tensor's
bytes in header order; ``Inference-Header-Content-Length`` gives the header's size.

Numeric arrays decoded from binary data are read-only views into the body (no copy) when
aligned. BYTES tensors are numpy object arrays of ``bytes``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import pydantic_core
from pydantic import BaseModel, ValidationError

from spillway.protocol.datatypes import datatype_of
from spillway.protocol.errors import InferenceError, InvalidInputError
from spillway.protocol.framing import (
    BINARY_CONTENT_TYPE,
    HEADER_LENGTH,
    JSON_CONTENT_TYPE,
    has_surrogate_escape,
    load_json_object,
    split_body,
    utf8_text,
)
from spillway.protocol.tensors import (
    CONTENT_TYPE_BASE64,
    Buffer,
    Tensor,
    base64_data,
    from_json,
    is_base64,
    json_data,
    tensor_from_bytes,
    wire_buffer,
)
from spillway.protocol.v2 import InferenceRequest, InferenceResponse, RequestInput, ResponseOutput
from spillway.protocol.wire import body_over_limit

__all__ = ["BINARY_CONTENT_TYPE", "HEADER_LENGTH", "JSON_CONTENT_TYPE"]

_Model = TypeVar("_Model", bound=BaseModel)


# --- bodies -------------------------------------------------------------------------------


def _validate(model: type[_Model], value: dict[str, Any], what: str) -> _Model:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        parts = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors[:3]]
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise InvalidInputError(f"invalid {what}: {'; '.join(parts)}{more}") from None


def _about(kind: str, name: str, error: InvalidInputError) -> InvalidInputError:
    """The error prefixed with the tensor it concerns, keeping its class (a function, not
    a context manager: this is on every request's path)."""
    return type(error)(f"{kind} {name!r}: {error.message}")


def _check_unique(names: Iterable[str], kind: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidInputError(f"{kind} {name!r} appears more than once")
        seen.add(name)


def _binary_size(parameters: dict[str, Any] | None) -> int | None:
    size = (parameters or {}).get("binary_data_size")
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidInputError("binary_data_size must be a non-negative integer")
    return size


def _decode_tensors(
    tensors: Sequence[RequestInput] | Sequence[ResponseOutput], binary: memoryview, kind: str
) -> dict[str, Tensor]:
    arrays: dict[str, Tensor] = {}
    offset = 0
    for tensor in tensors:
        try:
            size = _binary_size(tensor.parameters)
            if size is None:
                arrays[tensor.name] = from_json(
                    tensor.data, tensor.datatype, tensor.shape, tensor.parameters
                )
            elif tensor.data is not None:
                raise InvalidInputError("has both data and binary_data_size")
            elif is_base64(tensor.parameters, tensor.datatype):
                raise InvalidInputError(
                    'content_type "base64" is for JSON data; binary data is the raw bytes'
                )
            elif offset + size > len(binary):
                raise InvalidInputError(f"binary_data_size {size} runs past the end of the body")
            else:
                raw = binary[offset : offset + size]
                arrays[tensor.name] = tensor_from_bytes(raw, tensor.datatype, tensor.shape)
                offset += size
        except InvalidInputError as error:
            raise _about(kind, tensor.name, error) from None
        tensor.data = None  # the array holds the values now; free the JSON lists
    if offset != len(binary):
        raise InvalidInputError(f"{len(binary) - offset} bytes follow the last binary tensor")
    return arrays


def _encode_tensors(
    arrays: Mapping[str, Tensor], binary: Collection[str], kind: str, base64_bytes: bool = False
) -> tuple[list[dict[str, Any]], list[Buffer]]:
    tensors: list[dict[str, Any]] = []
    chunks: list[Buffer] = []
    for name, value in arrays.items():
        try:
            array = np.asarray(value)
            datatype = datatype_of(array)
            tensor: dict[str, Any] = {"name": name, "datatype": datatype}
            tensor["shape"] = list(array.shape)
            if name in binary:
                chunks.append(wire_buffer(array, datatype))
                tensor["parameters"] = {"binary_data_size": len(chunks[-1])}
            elif base64_bytes and datatype == "BYTES":
                tensor["parameters"] = {"content_type": CONTENT_TYPE_BASE64}
                tensor["data"] = base64_data(array)
            else:
                tensor["data"] = json_data(array, datatype)
        except InvalidInputError as error:
            raise _about(kind, name, error) from None
        tensors.append(tensor)
    return tensors, chunks


def _assemble(header: dict[str, Any], chunks: list[Buffer]) -> tuple[bytes, int | None]:
    # pydantic-core writes floats about 8x faster than json.dumps, with the same digits.
    # JSON has no NaN or Infinity: they are written as the strings "NaN", "Infinity" and
    # "-Infinity" (protobuf's JSON mapping), so every body stays valid JSON.
    head = pydantic_core.to_json(header, inf_nan_mode="strings")
    if not chunks:
        return head, None
    return b"".join([head, *chunks]), len(head)


def _flag(parameters: dict[str, Any] | None, key: str, default: bool) -> bool:
    value = (parameters or {}).get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidInputError(f"parameter {key!r} must be true or false")
    return value


# --- server side --------------------------------------------------------------------------


def decode_request(
    body: bytes, header_length: int | None, *, max_body_bytes: int | None = None
) -> tuple[InferenceRequest, dict[str, Tensor]]:
    """Parse an infer request body into its header model and one array per input.

    ``header_length`` is the ``Inference-Header-Content-Length`` value (``None``: the whole
    body is JSON). Raises ``PayloadTooLargeError`` past ``max_body_bytes``, else
    ``InvalidInputError`` (or its ``UnsupportedDatatypeError``) for any malformed body.
    """
    if max_body_bytes is not None and len(body) > max_body_bytes:
        raise body_over_limit(len(body), max_body_bytes)
    header, binary = split_body(body, header_length)
    request = _request_header(header)
    _check_unique((tensor.name for tensor in request.inputs), "input")
    return request, _decode_tensors(request.inputs, binary, "input")


def request_from_header(header: dict[str, Any]) -> InferenceRequest:
    """An infer request header already parsed into a dict (e.g. from another transport's
    message), validated as a JSON header is: the same model, the same unique input names
    and the same error messages."""
    request = _validate(InferenceRequest, header, "inference request")
    _check_unique((tensor.name for tensor in request.inputs), "input")
    return request


def _request_header(header: bytes) -> InferenceRequest:
    """The JSON header, parsed and validated in one pass by pydantic (about twice as fast
    as ``json.loads`` then validation: it is on every request's path). Whatever that pass
    refuses is read again the long way, so every error (bad JSON, a non-object, deep
    nesting, a field's problem) is reported exactly as ``load_json_object`` and
    ``_validate`` word it; both ways read ``NaN`` and keep the last of duplicate keys.
    Text pydantic would take but the core refuses (encoded or escaped surrogates) is
    checked first, so every server refuses it alike."""
    if not header.isascii():
        utf8_text(header)  # strict: pydantic's reader takes encoded surrogates
    if not has_surrogate_escape(header):
        try:
            return InferenceRequest.model_validate_json(header)
        except ValidationError:
            pass
    return _validate(InferenceRequest, load_json_object(header), "inference request")


def requested_outputs(request: InferenceRequest, available: Sequence[str]) -> list[str]:
    """The outputs to return, in the request's order; all of ``available`` if none listed."""
    if not request.outputs:
        return list(available)
    names = [output.name for output in request.outputs]
    known = set(available)
    for name in names:
        if name not in known:
            raise InvalidInputError(f"unknown output {name!r}; the model has {sorted(known)}")
    _check_unique(names, "output")
    return names


def binary_outputs_requested(request: InferenceRequest, output_names: Iterable[str]) -> set[str]:
    """Which of ``output_names`` go back as binary data (Triton's rules): the request's
    ``binary_data_output`` sets the default, an output's ``binary_data`` overrides it, and
    when the request lists outputs only those count."""
    default = _flag(request.parameters, "binary_data_output", False)
    if not request.outputs:
        return set(output_names) if default else set()
    listed = {o.name: _flag(o.parameters, "binary_data", default) for o in request.outputs}
    return {name for name in output_names if listed.get(name, False)}


def encode_response(
    model_name: str,
    model_version: str | None,
    request_id: str | None,
    outputs: Mapping[str, Tensor],
    *,
    binary: Collection[str] = frozenset(),
    parameters: dict[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """An infer response body and its header length (``None`` when nothing is binary).

    Outputs keep ``outputs``' order; those named in ``binary`` carry raw bytes after the
    JSON header. An output that cannot be encoded (a dtype with no V2 datatype, BYTES that
    are not UTF-8 in JSON) is the model's fault: ``InferenceError``.
    """
    header: dict[str, Any] = {"model_name": model_name}
    extras = {"model_version": model_version, "id": request_id, "parameters": parameters}
    header.update((key, value) for key, value in extras.items() if value is not None)
    try:
        header["outputs"], chunks = _encode_tensors(outputs, binary, "output")
    except InvalidInputError as exc:
        raise InferenceError(exc.message) from exc
    return _assemble(header, chunks)


# --- client side --------------------------------------------------------------------------


def encode_request(
    inputs: Mapping[str, Tensor],
    *,
    binary: bool,
    request_id: str | None = None,
    parameters: dict[str, Any] | None = None,
    outputs: Sequence[str] | None = None,
    binary_outputs: bool = False,
    base64_bytes: bool = False,
) -> tuple[bytes, int | None]:
    """An infer request body and its header length (``None`` when nothing is binary).

    ``binary`` sends every input as binary data; ``base64_bytes`` (without ``binary``)
    sends BYTES inputs in JSON as base64 strings (``content_type`` ``base64``: an image
    file in a JSON body or a WebSocket text frame); ``outputs`` lists the outputs wanted
    (default: all), and ``binary_outputs`` asks for them as binary data.
    """
    if not inputs:
        raise InvalidInputError("a request needs at least one input")
    header: dict[str, Any] = {} if request_id is None else {"id": request_id}
    params = dict(parameters or {})
    if binary_outputs and not outputs:
        params["binary_data_output"] = True
    if params:
        header["parameters"] = params
    header["inputs"], chunks = _encode_tensors(
        inputs, set(inputs) if binary else (), "input", base64_bytes
    )
    if outputs:
        wanted = {"binary_data": binary_outputs}
        header["outputs"] = [{"name": name, "parameters": wanted} for name in outputs]
    return _assemble(header, chunks)


def decode_response(
    body: bytes, header_length: int | None
) -> tuple[InferenceResponse, dict[str, Tensor]]:
    """Parse an infer response body into its header model and one array per output.

    A malformed response is the server's fault, not the caller's: ``InferenceError``.
    """
    try:
        header, binary = split_body(body, header_length)
        response = _validate(InferenceResponse, load_json_object(header), "inference response")
        _check_unique((tensor.name for tensor in response.outputs), "output")
        return response, _decode_tensors(response.outputs, binary, "output")
    except InvalidInputError as exc:
        raise InferenceError(f"malformed inference response: {exc.message}") from exc
