"""Batch-mode staging: an infer request (JSON or binary) as job input records."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest

from functions.router.staging import records
from spillway.errors import InvalidInputError


def lines(header: dict[str, Any], binary: bytes = b"") -> list[dict[str, Any]]:
    return [json.loads(line) for line in records(header, binary, "req")]


def test_json_rows_lose_the_batch_dimension_and_keep_their_nesting() -> None:
    header = {
        "inputs": [
            {
                "name": "image",
                "shape": [2, 2, 2],
                "datatype": "FP32",
                "data": [1, 2, 3, 4, 5, 6, 7, 8],
            },
            {"name": "text", "shape": [2, 1], "datatype": "BYTES", "data": [["a"], ["b"]]},
        ]
    }
    assert lines(header) == [
        {"id": "req-0", "data": {"image": [[1, 2], [3, 4]], "text": ["a"]}},
        {"id": "req-1", "data": {"image": [[5, 6], [7, 8]], "text": ["b"]}},
    ]


def test_binary_tensors_give_the_same_rows_as_json() -> None:
    values = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]
    texts = [b"hello", "h\u00e9".encode()]
    packed = b"".join(struct.pack("<I", len(t)) + t for t in texts)
    header = {
        "inputs": [
            {
                "name": "x",
                "shape": [2, 3],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 24},
            },
            {
                "name": "t",
                "shape": [2],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": len(packed)},
            },
        ]
    }
    binary = struct.pack("<6f", *values) + packed
    as_json = {
        "inputs": [
            {"name": "x", "shape": [2, 3], "datatype": "FP32", "data": values},
            {"name": "t", "shape": [2], "datatype": "BYTES", "data": ["hello", "h\u00e9"]},
        ]
    }
    assert lines(header, binary) == lines(as_json)
    assert lines(header, binary)[1]["data"] == {"x": [3.5, 4.5, 5.5], "t": "h\u00e9"}


@pytest.mark.parametrize(
    ("header", "binary", "message"),
    [
        ({"inputs": []}, b"", "needs inputs"),
        (
            {"inputs": [{"name": "x", "shape": [], "datatype": "FP32", "data": [1]}]},
            b"",
            "no batch",
        ),
        (
            {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1]}]},
            b"",
            "needs 2",
        ),
        (
            {"inputs": [{"name": "x", "shape": [1], "datatype": "FP99", "data": [1]}]},
            b"",
            "datatype",
        ),
        (
            {
                "inputs": [
                    {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
                    {"name": "y", "shape": [2], "datatype": "FP32", "data": [1, 2]},
                ]
            },
            b"",
            "same number of rows",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": [2],
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": 8},
                    }
                ]
            },
            b"\x00" * 4,
            "binary_data_size",
        ),
        (
            {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]},
            b"\x00",
            "follow the last",
        ),
    ],
)
def test_malformed_requests_are_the_clients_error(
    header: dict[str, Any], binary: bytes, message: str
) -> None:
    with pytest.raises(InvalidInputError, match=message):
        records(header, binary, "req")
