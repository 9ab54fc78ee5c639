"""``"parameters": {"content_type": "base64"}`` on a JSON BYTES tensor: each string is the
base64 of the element's bytes, decoded where every server decodes a request
(``spillway.protocol.codec.decode_request``); a client writes it with
``encode_request(..., base64_bytes=True)``."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from spillway.protocol.codec import decode_request, encode_request
from spillway.protocol.errors import InvalidInputError

PNG = b"\x89PNG\r\n\x1a\n\x00\xff"


def body(*inputs: dict[str, Any]) -> bytes:
    return json.dumps({"inputs": list(inputs)}).encode()


def image(data: list[Any], parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    tensor: dict[str, Any] = {"name": "image", "shape": [len(data)], "datatype": "BYTES"}
    tensor["data"] = data
    tensor["parameters"] = {"content_type": "base64"} if parameters is None else parameters
    return tensor


def refused(raw: bytes, header_length: int | None = None) -> str:
    with pytest.raises(InvalidInputError) as caught:
        decode_request(raw, header_length)
    assert (caught.value.status, caught.value.code) == (400, "invalid_input")
    return caught.value.message


def test_each_element_is_the_bytes_its_base64_decodes_to() -> None:
    # GIVEN bytes that are no UTF-8 text, and an empty element, as base64
    strings = [base64.b64encode(PNG).decode(), ""]
    # WHEN the request is decoded THEN the array holds the bytes themselves
    _, arrays = decode_request(body(image(strings)), None)
    assert arrays["image"].tolist() == [PNG, b""]


def test_the_client_writes_what_the_server_reads() -> None:
    inputs = {
        "image": np.array([[PNG], [b"GIF8"]], dtype=np.object_),
        "offset": np.array([[0.5], [1.0]], dtype=np.float32),
    }
    raw, length = encode_request(inputs, binary=False, base64_bytes=True)
    # THEN it is all JSON, the BYTES input marked base64, and decodes to the same arrays
    assert length is None
    sent = json.loads(raw)["inputs"]
    assert sent[0]["parameters"] == {"content_type": "base64"}
    assert "parameters" not in sent[1]
    _, arrays = decode_request(raw, None)
    assert arrays["image"].tolist() == [[PNG], [b"GIF8"]]
    np.testing.assert_array_equal(arrays["offset"], inputs["offset"])


@pytest.mark.parametrize("text", ["not base64!", "YWJj\n", "YWJ", "ñw==", "YW-_"])
def test_a_string_that_is_not_padded_standard_base64_is_refused(text: str) -> None:
    message = refused(body(image(["YWJj", text])))
    assert message.startswith("input 'image': element 1 is not base64"), message


def test_base64_on_another_datatype_or_on_binary_data_is_refused() -> None:
    floats = {
        "name": "x",
        "shape": [1],
        "datatype": "FP32",
        "parameters": {"content_type": "base64"},
        "data": [1.0],
    }
    assert refused(body(floats)) == "input 'x': content_type \"base64\" is for BYTES data, not FP32"
    # a binary tensor is raw bytes already
    header = body(
        {
            "name": "image",
            "shape": [1],
            "datatype": "BYTES",
            "parameters": {"content_type": "base64", "binary_data_size": 8},
        }
    )
    message = refused(header + b"\x04\x00\x00\x00YWJj", len(header))
    assert "is for JSON data" in message


def test_without_base64_a_string_is_its_utf8_and_other_content_types_read_as_before() -> None:
    for parameters in ({}, {"content_type": "str"}):
        _, arrays = decode_request(body(image(["YWJj"], parameters)), None)
        assert arrays["image"].tolist() == [b"YWJj"]
