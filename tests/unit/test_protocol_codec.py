"""Open Inference Protocol models and the JSON / binary tensor codec.

Round trips for every datatype in both encodings, a cross-check against the real
``tritonclient.http`` wire format, and the malformed bodies a server must refuse cleanly.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from spillway.inference import check_priority
from spillway.models.config import ModelConfig
from spillway.protocol.codec import (
    binary_outputs_requested,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    requested_outputs,
)
from spillway.protocol.datatypes import NUMPY_DTYPES
from spillway.protocol.errors import (
    InferenceError,
    InvalidInputError,
    PayloadTooLargeError,
    SpillwayError,
    UnsupportedDatatypeError,
)
from spillway.protocol.framing import NOT_UTF8, load_json_object, parse_header_length
from spillway.protocol.tensors import tensor_from_bytes, tensor_to_bytes
from spillway.protocol.v2 import (
    InferenceRequest,
    MetadataModelResponse,
    MetadataServerResponse,
)
from spillway.protocol.wire import InferParameters

DATATYPES = list(NUMPY_DTYPES)
PROPERTY = settings(max_examples=40, deadline=None)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
TEXT = st.text(max_size=6)  # includes "", non-ASCII and astral characters; no surrogates
BLOBS = st.one_of(TEXT.map(str.encode), st.binary(max_size=6))  # binary mode: any bytes


def object_array(items: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out.reshape(shape)


@st.composite
def tensors(draw: st.DrawFn, datatype: str, *, utf8: bool = True) -> np.ndarray:
    """Arrays of ``datatype`` with random small shapes; floats include NaN and infinities."""
    shape = draw(SHAPES)
    if datatype != "BYTES":
        return draw(hnp.arrays(NUMPY_DTYPES[datatype], shape))
    count = int(np.prod(shape))
    items = draw(st.lists(TEXT.map(str.encode) if utf8 else BLOBS, min_size=count, max_size=count))
    return object_array(items, shape)


def any_tensor(*, utf8: bool = True) -> st.SearchStrategy[np.ndarray]:
    return st.sampled_from(DATATYPES).flatmap(lambda dt: tensors(dt, utf8=utf8))


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal values (NaN equals NaN), shape and dtype."""
    np.testing.assert_array_equal(actual, expected, strict=True)


def assert_client_error(exc: SpillwayError, cls: type[SpillwayError]) -> None:
    assert type(exc) is cls
    assert (exc.status, exc.code) == (cls.status, cls.code)
    assert exc.message
    assert "pydantic" not in exc.message.lower()
    assert "Traceback" not in exc.message


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", DATATYPES)
@PROPERTY
@given(data=st.data())
def test_request_round_trip(datatype: str, binary: bool, data: st.DataObject) -> None:
    # GIVEN a tensor of the datatype and a second tensor of any datatype after it
    utf8 = not binary
    inputs = {"x": data.draw(tensors(datatype, utf8=utf8)), "y": data.draw(any_tensor(utf8=utf8))}
    # WHEN a client encodes them and the server decodes the body
    body, header_length = encode_request(inputs, binary=binary, request_id="r-1")
    request, arrays = decode_request(body, header_length)
    # THEN the server sees the same arrays, in order, and no leftover JSON lists
    assert (header_length is not None) == binary
    assert list(arrays) == ["x", "y"]
    for name, expected in inputs.items():
        assert_same(arrays[name], expected)
    assert request.id == "r-1"
    assert [tensor.data for tensor in request.inputs] == [None, None]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", DATATYPES)
@PROPERTY
@given(data=st.data())
def test_response_round_trip(datatype: str, binary: bool, data: st.DataObject) -> None:
    # GIVEN outputs where only the first one is asked for in the chosen encoding
    first = data.draw(tensors(datatype, utf8=not binary))
    outputs = {"out": first, "other": data.draw(any_tensor())}
    # WHEN the server encodes the response and a client decodes it
    binary_names = {"out"} if binary else set()
    body, header_length = encode_response("m", "2", "r-9", outputs, binary=binary_names)
    response, arrays = decode_response(body, header_length)
    # THEN the client sees the same arrays and the response metadata
    assert (header_length is not None) == binary
    assert list(arrays) == ["out", "other"]
    for name, expected in outputs.items():
        assert_same(arrays[name], expected)
    assert (response.model_name, response.model_version, response.id) == ("m", "2", "r-9")


@PROPERTY
@given(outputs=st.dictionaries(st.text(min_size=1, max_size=5), any_tensor(), max_size=4))
def test_response_mixes_binary_and_json_outputs(outputs: dict[str, np.ndarray]) -> None:
    # GIVEN every other output requested as binary data
    binary = set(list(outputs)[::2])
    # WHEN encoded and decoded
    body, header_length = encode_response("m", None, None, outputs, binary=binary)
    response, arrays = decode_response(body, header_length)
    # THEN each binary chunk lands on its own output, and only binary outputs carry a size
    assert list(arrays) == list(outputs)
    for name, expected in outputs.items():
        assert_same(arrays[name], expected)
    sized = {
        o.name for o in response.outputs if o.parameters and "binary_data_size" in o.parameters
    }
    assert sized == binary
    assert response.model_version is None
    assert response.id is None


def test_json_response_is_compact_and_row_major() -> None:
    # GIVEN a 2x2 FP16 output and a BYTES output with non-ASCII text
    outputs = {
        "p": np.array([[0.5, 1.0], [-2.0, 65504.0]], dtype=np.float16),
        "s": object_array(["é".encode(), b""], (2,)),
    }
    # WHEN encoded as JSON
    body, header_length = encode_response("m", "1", "id", outputs)
    # THEN the body is one compact JSON document with flat row-major data
    assert header_length is None
    assert b" " not in body
    assert json.loads(body)["outputs"] == [
        {"name": "p", "datatype": "FP16", "shape": [2, 2], "data": [0.5, 1.0, -2.0, 65504.0]},
        {"name": "s", "datatype": "BYTES", "shape": [2], "data": ["é", ""]},
    ]


@pytest.mark.parametrize(
    "data", [[[1, 2], [3, 4]], [1, 2, 3, 4], [[[1, 2, 3, 4]]]], ids=["nested", "flat", "other"]
)
def test_json_data_may_be_flat_or_nested(data: Any) -> None:
    # GIVEN INT32 data for shape [2, 2], nested or flat
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT32", "data": data}]}
    ).encode()
    # WHEN decoded
    _, arrays = decode_request(body, None)
    # THEN the array has the declared shape, filled row-major
    assert_same(arrays["x"], np.array([[1, 2], [3, 4]], dtype=np.int32))


def test_binary_bool_and_bytes_layout() -> None:
    # GIVEN BOOL, FP16, INT32 and BYTES tensors
    # WHEN serialized for the binary extension
    # THEN the layout is little-endian, one byte per BOOL, length-prefixed BYTES
    assert tensor_to_bytes(np.array([True, False]), "BOOL") == b"\x01\x00"
    assert tensor_to_bytes(np.array([1.0], dtype=np.float16), "FP16") == b"\x00\x3c"
    assert tensor_to_bytes(np.array([1, -2], dtype=np.int32), "INT32") == struct.pack("<2i", 1, -2)
    strings = object_array([b"ab", b""], (2,))
    assert tensor_to_bytes(strings, "BYTES") == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
    assert_same(tensor_from_bytes(b"\x02\x00\x00\x00ab\x00\x00\x00\x00", "BYTES", [2]), strings)
    assert_same(tensor_from_bytes(b"\x01\x07\x00", "BOOL", [3]), np.array([True, True, False]))


def test_tensor_to_bytes_refuses_a_mismatched_datatype() -> None:
    # GIVEN an INT64 array WHEN sent as INT32 THEN it is refused rather than silently cast
    with pytest.raises(InvalidInputError, match="cannot be sent as INT32"):
        tensor_to_bytes(np.array([1], dtype=np.int64), "INT32")


# --- tritonclient cross-checks --------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", DATATYPES)
@PROPERTY
@given(data=st.data())
def test_decodes_what_tritonclient_sends(datatype: str, binary: bool, data: st.DataObject) -> None:
    # GIVEN a request body built by the real tritonclient
    arrays = [data.draw(tensors(datatype, utf8=not binary)), data.draw(any_tensor(utf8=True))]
    inputs = []
    for index, array in enumerate(arrays):
        tensor = triton.InferInput(f"in{index}", list(array.shape), _triton_datatype(array))
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    body, json_size = triton.InferenceServerClient.generate_request_body(inputs, request_id="t")
    # WHEN the server decodes it
    request, decoded = decode_request(body, json_size)
    # THEN it sees the client's arrays, and tritonclient's default asks for binary outputs
    for index, array in enumerate(arrays):
        assert_same(decoded[f"in{index}"], array)
    assert request.id == "t"
    assert binary_outputs_requested(request, ["a", "b"]) == {"a", "b"}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", DATATYPES)
@PROPERTY
@given(data=st.data())
def test_tritonclient_reads_our_response(datatype: str, binary: bool, data: st.DataObject) -> None:
    # GIVEN a response the server encoded, the first output in the chosen encoding
    outputs = {"a": data.draw(tensors(datatype, utf8=not binary)), "b": data.draw(any_tensor())}
    body, header_length = encode_response("m", "1", "r", outputs, binary={"a"} if binary else ())
    # WHEN the real tritonclient parses it
    result = triton.InferenceServerClient.parse_response_body(
        body, verbose=False, header_length=header_length, content_encoding=None
    )
    # THEN it reads the same arrays (tritonclient gives JSON BYTES back as str)
    assert_same(_as_bytes(result.as_numpy("a")), outputs["a"])
    assert_same(_as_bytes(result.as_numpy("b")), outputs["b"])
    assert result.get_response()["model_name"] == "m"


def _triton_datatype(array: np.ndarray) -> str:
    return next(name for name, dtype in NUMPY_DTYPES.items() if dtype == array.dtype)


def _as_bytes(array: np.ndarray) -> np.ndarray:
    if array.dtype != np.object_:
        return array
    items = [item.encode() if isinstance(item, str) else item for item in array.reshape(-1)]
    return object_array(items, array.shape)


# --- output selection -----------------------------------------------------------------------


def _request(**fields: Any) -> InferenceRequest:
    tensor = {"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}
    return InferenceRequest.model_validate({"inputs": [tensor], **fields})


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, set()),
        ({"parameters": {"binary_data_output": True}}, {"a", "b"}),
        ({"parameters": {"binary_data_output": False}}, set()),
        ({"outputs": [{"name": "a", "parameters": {"binary_data": True}}, {"name": "b"}]}, {"a"}),
        (
            {
                "parameters": {"binary_data_output": True},
                "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": False}}],
            },
            {"a"},
        ),
        ({"parameters": {"binary_data_output": True}, "outputs": [{"name": "b"}]}, {"b"}),
    ],
    ids=["default-json", "all-binary", "all-json", "per-output", "override-wins", "only-listed"],
)
def test_binary_outputs_follow_triton_rules(fields: dict[str, Any], expected: set[str]) -> None:
    # GIVEN a request's binary settings WHEN resolved for outputs a and b THEN Triton's rules hold
    assert binary_outputs_requested(_request(**fields), ["a", "b"]) == expected


def test_binary_flag_must_be_a_boolean() -> None:
    # GIVEN binary_data_output sent as a string WHEN resolved THEN it is a client error
    with pytest.raises(InvalidInputError) as caught:
        binary_outputs_requested(_request(parameters={"binary_data_output": "yes"}), ["a"])
    assert_client_error(caught.value, InvalidInputError)


def test_requested_outputs() -> None:
    # GIVEN a model with outputs a, b, c
    available = ["a", "b", "c"]
    # WHEN the request lists none, some, an unknown one or a duplicate
    # THEN all in model order, the listed ones in request order, or a client error
    assert requested_outputs(_request(), available) == available
    listed = _request(outputs=[{"name": "c"}, {"name": "a"}])
    assert requested_outputs(listed, available) == ["c", "a"]
    for outputs in ([{"name": "zz"}], [{"name": "a"}, {"name": "a"}]):
        with pytest.raises(InvalidInputError) as caught:
            requested_outputs(_request(outputs=outputs), available)
        assert_client_error(caught.value, InvalidInputError)


def test_encode_request_asks_for_outputs() -> None:
    # GIVEN a client asking for output "y" as binary, with a custom parameter
    body, _ = encode_request(
        {"x": np.zeros(1, np.float32)},
        binary=False,
        parameters={"priority": 1},
        outputs=["y"],
        binary_outputs=True,
    )
    # WHEN the server decodes it
    request, _ = decode_request(body, None)
    # THEN the output selection and the parameter arrive
    assert binary_outputs_requested(request, ["y", "z"]) == {"y"}
    assert requested_outputs(request, ["y", "z"]) == ["y"]
    assert request.parameters == {"priority": 1}


# --- malformed bodies -----------------------------------------------------------------------


def _json(*inputs: dict[str, Any]) -> tuple[bytes, None]:
    return json.dumps({"inputs": list(inputs)}).encode(), None


def _binary(tensor: dict[str, Any], size: int, raw: bytes) -> tuple[bytes, int]:
    tensor = {**tensor, "parameters": {"binary_data_size": size}}
    header = json.dumps({"inputs": [tensor]}).encode()
    return header + raw, len(header)


def _fp32(**fields: Any) -> dict[str, Any]:
    return {"name": "x", "shape": [2], "datatype": "FP32", **fields}


TWO_FLOATS = struct.pack("<2f", 1.0, 2.0)
STRING = {"name": "s", "shape": [1], "datatype": "BYTES"}
VALID = _json(_fp32(data=[1, 2]))[0]
MALFORMED: dict[str, tuple[tuple[bytes, int | None], str]] = {
    "bad-json": ((b'{"inputs": [', None), "invalid JSON"),
    "json-array": ((b"[1, 2]", None), "must be an object"),
    "not-utf8": ((b'{"id": "\xff"}', None), "not UTF-8"),
    "deep-nesting": ((b"[" * 100_000 + b"]" * 100_000, None), "nested too deeply"),
    "huge-integer": ((b"[" + b"9" * 10_000 + b"]", None), "too long"),
    "no-inputs": ((b'{"inputs": []}', None), "inputs: List should have at least 1 item"),
    "header-past-body": ((VALID, len(VALID) + 1), "outside the body"),
    "negative-header": ((VALID, -1), "outside the body"),
    "too-few-bytes": (_binary(_fp32(), 8, TWO_FLOATS[:4]), "runs past the end"),
    "leftover-bytes": (_binary(_fp32(), 8, TWO_FLOATS + b"\0" * 4), "4 bytes follow"),
    "size-vs-shape": (_binary(_fp32(), 4, TWO_FLOATS[:4]), "needs 8 bytes, got 4"),
    "negative-size": (_binary(_fp32(), -8, TWO_FLOATS), "non-negative integer"),
    "string-size": (_binary(_fp32(), "8", TWO_FLOATS), "non-negative integer"),  # type: ignore[arg-type]
    "data-and-size": (_binary(_fp32(data=[1, 2]), 8, TWO_FLOATS), "both data and"),
    "binary-without-header": (_json(_fp32(parameters={"binary_data_size": 8})), "past the end"),
    "bytes-truncated": (_binary(STRING, 7, struct.pack("<I", 10) + b"abc"), "truncated"),
    "bytes-leftover": (_binary(STRING, 8, struct.pack("<I", 1) + b"abcd"), "3 bytes after"),
    "bytes-huge-shape": (
        _binary({**STRING, "shape": [10**12]}, 4, b"\0" * 4),
        "less than or equal to 2147483647",
    ),
    "bytes-large-shape": (_binary({**STRING, "shape": [10**6]}, 4, b"\0" * 4), "cannot hold"),
    "rank-65": (_json(_fp32(shape=[1] * 65, data=[1])), "at most 16 items"),
    "zero-beside-huge": (_json(_fp32(shape=[0, 2**62], data=[])), "inputs.0.shape.1"),
    "zero-beside-big": (_json(_fp32(shape=[0, 2**20, 2**20], data=[])), "at most 2147483647"),
    "count-mismatch": (_json(_fp32(data=[1, 2, 3])), "needs 2 elements, data has 3"),
    "ragged": (_json(_fp32(data=[[1], 2])), "mixes nested arrays"),
    "string-in-fp32": (_json(_fp32(data=[1.0, "2"])), "FP32 data may not hold string"),
    "null-in-fp32": (_json(_fp32(data=[1.0, None])), "may not hold null"),
    "bool-in-fp32": (_json(_fp32(data=[1.0, True])), "may not hold boolean"),
    "fraction-in-int": (_json(_fp32(datatype="INT32", data=[1, 2.5])), "floating-point"),
    "int8-overflow": (_json(_fp32(datatype="INT8", data=[1, 300])), "out of range for INT8"),
    "uint8-negative": (_json(_fp32(datatype="UINT8", data=[1, -1])), "out of range for UINT8"),
    "uint64-overflow": (_json(_fp32(datatype="UINT64", data=[0, 2**64])), "out of range"),
    "number-in-bool": (_json(_fp32(datatype="BOOL", data=[True, 1])), "may not hold integer"),
    "number-in-bytes": (_json(_fp32(datatype="BYTES", data=["a", 1])), "may not hold integer"),
    "missing-data": (_json(_fp32()), "neither data nor"),
    "negative-dim": (_json(_fp32(shape=[-2], data=[1, 2])), "inputs.0.shape.0"),
    "string-dim": (_json(_fp32(shape=["2"], data=[1, 2])), "inputs.0.shape.0"),
    "string-id": (
        (b'{"id": 7, "inputs": [' + json.dumps(_fp32(data=[1, 2])).encode() + b"]}", None),
        "id: Input should be a valid string",
    ),
    "duplicate-input": (_json(_fp32(data=[1, 2]), _fp32(data=[3, 4])), "more than once"),
}


@pytest.mark.parametrize(("request_body", "reason"), MALFORMED.values(), ids=MALFORMED)
def test_malformed_request_is_a_clean_client_error(
    request_body: tuple[bytes, int | None], reason: str
) -> None:
    # GIVEN a malformed body WHEN decoded
    with pytest.raises(SpillwayError) as caught:
        decode_request(*request_body)
    # THEN InvalidInputError (400, invalid_input) saying what is wrong, without internals
    assert_client_error(caught.value, InvalidInputError)
    assert reason in caught.value.message


@pytest.mark.parametrize(
    ("body", "header_length"),
    [_json(_fp32(datatype="FP8", data=[1, 2])), _binary(_fp32(datatype="BF16"), 4, b"\0" * 4)],
    ids=["json", "binary"],
)
def test_unknown_datatype(body: bytes, header_length: int | None) -> None:
    # GIVEN an input with a datatype the protocol does not define
    # WHEN decoded THEN UnsupportedDatatypeError: a 400 with its own code
    with pytest.raises(SpillwayError) as caught:
        decode_request(body, header_length)
    assert_client_error(caught.value, UnsupportedDatatypeError)
    assert isinstance(caught.value, InvalidInputError)
    assert (caught.value.status, caught.value.code) == (400, "unsupported_datatype")


def test_error_names_the_input() -> None:
    # GIVEN a string among FP32 data WHEN decoded THEN the message says which input and why
    body, _ = _json(_fp32(name="pixels", data=[1.0, "2"]))
    with pytest.raises(InvalidInputError, match=r"input 'pixels': FP32 data may not hold string"):
        decode_request(body, None)


def test_body_over_the_cap_is_413() -> None:
    # GIVEN a valid body one byte over the cap
    body, _ = _json(_fp32(data=[1, 2]))
    # WHEN decoded with that cap THEN PayloadTooLargeError (413); at the cap it decodes
    with pytest.raises(PayloadTooLargeError) as caught:
        decode_request(body, None, max_body_bytes=len(body) - 1)
    assert_client_error(caught.value, PayloadTooLargeError)
    assert caught.value.status == 413
    _, arrays = decode_request(body, None, max_body_bytes=len(body))
    assert_same(arrays["x"], np.array([1, 2], dtype=np.float32))


def test_truncated_bytes_element() -> None:
    # GIVEN a BYTES element whose length prefix promises more than follows
    # WHEN parsed THEN a client error, not an IndexError or a short element
    with pytest.raises(InvalidInputError, match="truncated") as caught:
        tensor_from_bytes(struct.pack("<I", 5) + b"abc", "BYTES", [1])
    assert_client_error(caught.value, InvalidInputError)


@pytest.mark.parametrize("junk", ["12x", "+368", "1_0", "-1", "٣", "", "1" * 13])
def test_header_length_from_header_value(junk: str) -> None:
    # GIVEN header values WHEN parsed THEN an int, None when absent, a client error for
    # anything but plain ASCII digits (one rule for every transport)
    assert parse_header_length("123") == 123
    assert parse_header_length(" 7 ") == 7
    assert parse_header_length(None) is None
    with pytest.raises(InvalidInputError):
        parse_header_length(junk)


# --- server-side failures -------------------------------------------------------------------


def test_non_utf8_bytes_output_needs_binary() -> None:
    # GIVEN a model output holding bytes that are not UTF-8
    outputs = {"blob": object_array([b"\xff\xfe"], (1,))}
    # WHEN encoded as JSON THEN the model's fault: InferenceError (500)
    with pytest.raises(InferenceError, match="blob") as caught:
        encode_response("m", None, None, outputs)
    assert (caught.value.status, caught.value.code) == (500, "inference_failed")
    # AND as binary data it round-trips
    body, header_length = encode_response("m", None, None, outputs, binary={"blob"})
    assert_same(decode_response(body, header_length)[1]["blob"], outputs["blob"])


def test_output_without_v2_datatype_is_an_inference_error() -> None:
    # GIVEN a complex output WHEN encoded THEN InferenceError, not a client error
    with pytest.raises(InferenceError, match="complex"):
        encode_response("m", None, None, {"z": np.zeros(2, dtype=np.complex64)})


def test_malformed_response_is_an_inference_error() -> None:
    # GIVEN a response body whose binary output is short WHEN a client decodes it
    header = b'{"model_name":"m","outputs":[{"name":"o","shape":[2],"datatype":"FP32",'
    header += b'"parameters":{"binary_data_size":8}}]}'
    # THEN InferenceError: the server broke the protocol, not the caller
    with pytest.raises(InferenceError, match="malformed inference response"):
        decode_response(header + b"\0" * 4, len(header))


# --- protocol models ------------------------------------------------------------------------


def test_metadata_models_accept_variable_dims_and_dump_the_spec_shape() -> None:
    # GIVEN model metadata with a batch dimension of -1
    metadata = MetadataModelResponse.model_validate(
        {
            "name": "digits",
            "versions": ["1"],
            "platform": "onnxruntime_onnx",
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
            "outputs": [{"name": "label", "datatype": "INT64", "shape": [-1, 1]}],
        }
    )
    # WHEN dumped THEN the spec's field names come back
    dumped = metadata.model_dump(exclude_none=True)
    assert dumped["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    server = MetadataServerResponse(name="spillway", version="0.1.0", extensions=["statistics"])
    assert server.model_dump()["extensions"] == ["statistics"]


def test_request_parameters_are_open_for_extension() -> None:
    # GIVEN request parameters the spec does not name WHEN validated THEN they are kept
    request = _request(parameters={"priority": 1, "custom": {"k": [1, 2]}})
    assert request.parameters == {"priority": 1, "custom": {"k": [1, 2]}}


def test_non_finite_outputs_stay_valid_json_and_read_back() -> None:
    # GIVEN outputs holding NaN and infinities
    values = np.array([[np.nan, np.inf, -np.inf, 1.5]], dtype=np.float32)
    # WHEN encoded as JSON
    body, length = encode_response("m", "1", None, {"y": values})

    # THEN the body is strict JSON (no bare NaN) and reads back to the same values
    def refuse(constant: str) -> None:
        raise AssertionError(f"bare {constant} in the body")

    header = json.loads(body, parse_constant=refuse)
    assert header["outputs"][0]["data"] == ["NaN", "Infinity", "-Infinity", 1.5]
    _, outputs = decode_response(body, length)
    np.testing.assert_array_equal(outputs["y"], values)


def test_a_timeout_of_zero_means_none() -> None:
    # GIVEN requests with timeout 0 (Triton: no timeout) and with a real timeout
    from spillway.protocol.wire import InferParameters

    # WHEN their parameters are read THEN 0 is "no timeout", not "expire at once"
    assert InferParameters.of({"timeout": 0}).timeout_s is None
    assert InferParameters.of({"timeout": 2_500}).timeout_s == 0.0025
    with pytest.raises(InvalidInputError):
        InferParameters.of({"timeout": 10**400})


_FOUR = b'"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]'


@pytest.mark.parametrize(
    "header",
    [
        b'{"id": "\xff", ' + _FOUR + b"}",  # not UTF-8 at all
        b'{"id": "\xc0\xaf", ' + _FOUR + b"}",  # an overlong form
        b'{"id": "\xed\xa0\x80", ' + _FOUR + b"}",  # an encoded surrogate (pydantic takes it)
        b'{"parameters": {"n": "\xed\xbf\xbf"}, ' + _FOUR + b"}",
        b'{"id": "\\ud800", ' + _FOUR + b"}",  # an escaped lone surrogate
        b'{"parameters": {"n": ["x\\uDFFF"]}, ' + _FOUR + b"}",
        b'{"id": "\\udc00\\ud800", ' + _FOUR + b"}",  # a pair in the wrong order
    ],
)
def test_text_that_is_not_utf8_is_refused_by_one_rule(header: bytes) -> None:
    # GIVEN JSON text no UTF-8 answer could carry back WHEN a server decodes it (the fast
    # path) or the router reads it (load_json_object) THEN both refuse it, word for word
    with pytest.raises(InvalidInputError) as decoded:
        decode_request(header, None)
    with pytest.raises(InvalidInputError) as read:
        load_json_object(header)
    assert decoded.value.message == read.value.message == NOT_UTF8


def test_escaped_pairs_and_non_ascii_text_are_read() -> None:
    header = '{"id": "\\ud83d\\ude00 ünï", ' + _FOUR.decode() + "}"
    request, _ = decode_request(header.encode(), None)
    assert request.id == "\U0001f600 ünï"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"mode": "bogus"}, "mode must be one of"),
        ({"latency_budget_ms": 99}, "latency_budget_ms must be between 100 and 3600000"),
        ({"latency_budget_ms": float("inf")}, "latency_budget_ms must be a finite number"),
        ({"tenant": "no spaces"}, "tenant must be 1-128 letters"),
        ({"priority": 1_000_001}, "parameter 'priority' must be at most 1000000"),
    ],
)
def test_routing_parameters_are_checked_by_the_core(
    parameters: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidInputError, match=message):
        InferParameters.of(parameters)


def test_a_priority_is_checked_against_the_models_levels() -> None:
    two = ModelConfig.model_validate(
        {
            "name": "m",
            "max_batch_size": 4,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}],
            "dynamic_batching": {"priority_levels": 2},
        }
    )
    one = two.model_copy(update={"dynamic_batching": None})
    for priority in (0, 1, 2):
        check_priority(two, InferParameters(priority=priority))
    with pytest.raises(InvalidInputError, match="between 1 and 2 for 'm', or 0"):
        check_priority(two, InferParameters(priority=3))
    with pytest.raises(InvalidInputError, match="between 1 and 1 for 'm', or 0"):
        check_priority(one, InferParameters(priority=2))
