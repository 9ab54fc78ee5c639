"""Job records: JSON rows to tensors with the served datatypes, outputs back to JSON."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batch_job.records import (
    RecordError,
    bounded_lines,
    output_lines,
    shortest_float32,
    split_record,
    to_tensors,
)
from spillway.models.config import TensorConfig
from spillway.protocol.errors import InferenceError, InvalidInputError
from spillway.protocol.tensors import from_json_nested

TEXT = TensorConfig(name="text", data_type="TYPE_STRING", dims=(1,))
IMAGE = TensorConfig(name="image", data_type="TYPE_FP32", dims=(2, 2))
IDS = TensorConfig(name="ids", data_type="TYPE_INT32", dims=(-1,))
FLAG = TensorConfig(name="flag", data_type="TYPE_BOOL", dims=(1,))
SPECS = {t.name: t for t in (TEXT, IMAGE, IDS, FLAG)}


def test_a_bare_string_fills_a_text_input_of_one() -> None:
    tensors = to_tensors({"text": "héllo"}, SPECS, batch=True)
    assert tensors["text"].shape == (1, 1)
    assert tensors["text"].dtype == np.object_
    assert tensors["text"][0, 0] == "héllo".encode()


def test_nested_lists_become_one_row_of_the_served_dtype() -> None:
    tensors = to_tensors({"image": [[1, 2], [3.5, 4]], "ids": [7, 8, 9]}, SPECS, batch=True)
    assert tensors["image"].dtype == np.float32
    np.testing.assert_array_equal(tensors["image"], [[[1, 2], [3.5, 4]]])
    assert tensors["ids"].dtype == np.dtype(np.int32)
    assert tensors["ids"].shape == (1, 3)


def test_without_batching_no_dimension_is_added() -> None:
    assert to_tensors({"ids": [1, 2]}, SPECS, batch=False)["ids"].shape == (2,)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ({"image": [[1, 2], [3]]}, "rectangular"),
        ({"image": [["a", "b"], ["c", "d"]]}, "FP32"),
        ({"image": [[True, False], [True, True]]}, "FP32"),
        ({"ids": [1.5]}, "INT32"),
        ({"ids": [2**31]}, "out of range"),
        ({"ids": [2**70]}, "INT32"),
        ({"flag": [1]}, "BOOL"),
        ({"text": 5}, "BYTES"),
        ({"text": ["ok", ["nested"]]}, "rectangular"),
        ({"nope": 1}, "unknown input"),
        ({"ids": None}, "null"),
        ({"ids": [1, None]}, "null"),
        ({"image": [[{"a": 1}, 2], [3, 4]]}, "object"),
        ({"ids": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}, "more than 16 dimensions"),
    ],
)
def test_values_that_do_not_fit_the_datatype_are_invalid(data: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidInputError, match=reason):
        to_tensors(data, SPECS, batch=True)


def test_a_number_past_fp32_becomes_infinite_for_the_engine_to_refuse() -> None:
    # GIVEN a record whose FP32 value is past float32's range WHEN read THEN it is
    # infinite, as a gRPC client's fp32_contents make it; the engine's non-finite rule
    # then refuses the record (tests/unit/test_non_finite.py, test_jobs_shard.py)
    image = to_tensors({"image": [[1e39, 0], [0, 0]]}, SPECS, batch=True)["image"]
    assert image[0, 0, 0] == np.inf
    assert np.isfinite(image[0].ravel()[1:]).all()


@pytest.mark.parametrize(
    ("data", "datatype", "shape", "flat"),
    [
        ([[1, 2, 3], [4, 5, 6]], "INT64", (2, 3), [1, 2, 3, 4, 5, 6]),
        (7.5, "FP64", (), [7.5]),
        ([], "FP32", (0,), []),
        ([[], []], "INT8", (2, 0), []),
        ([[["a"]], [["é"]]], "BYTES", (2, 1, 1), [b"a", "é".encode()]),
    ],
)
def test_the_nesting_of_json_lists_is_the_shape(
    data: Any, datatype: str, shape: tuple[int, ...], flat: list[Any]
) -> None:
    array = from_json_nested(data, datatype)
    assert (array.shape, array.reshape(-1).tolist()) == (shape, flat)


@pytest.mark.parametrize("ragged", [[[1, 2], [3]], [[1], 2], [1, [2]], [[[1]], [[1, 2]]]])
def test_ragged_json_lists_are_invalid(ragged: Any) -> None:
    with pytest.raises(InvalidInputError, match="rectangular"):
        from_json_nested(ragged, "FP32")


def test_split_record_reads_id_and_data_only_from_json() -> None:
    assert split_record(b'{"id": "x1", "data": {"text": "a"}}') == ("x1", {"text": "a"})
    with pytest.raises(InvalidInputError, match="'id' string"):
        split_record(json.dumps({"id": "x" * 257, "data": {}}).encode())
    with pytest.raises(InvalidInputError) as caught:
        split_record(b'{"id": "only-id"}')
    assert getattr(caught.value, "record_id", None) == "only-id"


def test_outputs_round_trip_float32_exactly() -> None:
    # GIVEN float32 and int64 outputs of a batch of three records
    values = np.random.default_rng(0).standard_normal((3, 384)).astype(np.float32)
    labels = np.array([[3], [1], [4]], dtype=np.int64)
    results: list[dict[str, np.ndarray]] = [
        {"embedding": values[i : i + 1], "label": labels[i : i + 1]} for i in range(3)
    ]
    # WHEN written as JSON lines and read back
    lines = [json.loads(x) for x in output_lines(["a", "b", "c"], results, batch=True)]
    # THEN each line has its own id and its own values, exactly
    assert [x["id"] for x in lines] == ["a", "b", "c"]
    for i, parsed in enumerate(lines):
        got = np.array(parsed["outputs"]["embedding"], np.float32)
        np.testing.assert_array_equal(got, values[i])
        assert parsed["outputs"]["label"] == [int(labels[i, 0])]


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=200))
def test_shortest_float32_reads_back_bit_for_bit(bits: list[int]) -> None:
    # GIVEN any float32 bit patterns (NaN aside: JSON has none)
    values = np.array(bits, dtype=np.uint32).view(np.float32)
    values = values[~np.isnan(values)]
    # WHEN shortened and written with json
    text = json.dumps(shortest_float32(values).tolist())
    # THEN the same float32 bits come back, usually in far fewer characters
    back = np.array(json.loads(text), dtype=np.float32)
    np.testing.assert_array_equal(back.view(np.uint32), values.view(np.uint32))


def test_shortest_float32_is_short() -> None:
    short = shortest_float32(np.array([0.1, 1 / 3, -2.5e-8, 3e20, 0], dtype=np.float32))
    assert [repr(x) for x in short.tolist()] == ["0.1", "0.33333334", "-2.5e-08", "3e+20", "0.0"]


def test_error_lines_carry_id_reason_code_and_place() -> None:
    error = RecordError.of(InferenceError("boom"), "r9", line=4)
    assert json.loads(error.to_json()) == {
        "id": "r9",
        "error": "boom",
        "code": "inference_failed",
        "line": 4,
    }


def _strict(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_outputs_are_written_as_json_strings() -> None:
    # GIVEN float32 and float64 outputs holding NaN and both infinities
    y32 = np.array([[np.nan, np.inf, -np.inf, 0.5]], dtype=np.float32)
    y64 = np.array([[-np.inf, 2.0]], dtype=np.float64)
    # WHEN written as output lines
    (text,) = output_lines(["a"], [{"y32": y32, "y64": y64}], batch=True)
    # THEN the line is strict JSON with the core's spelling of non-finite values
    assert _strict(text) == {
        "id": "a",
        "outputs": {"y32": ["NaN", "Infinity", "-Infinity", 0.5], "y64": ["-Infinity", 2.0]},
    }


class _Spy(io.BytesIO):
    """Records the longest piece of a line ever handed out."""

    longest = 0

    def readline(self, size: int | None = -1, /) -> bytes:
        piece = super().readline(size)
        self.longest = max(self.longest, len(piece))
        return piece


@pytest.mark.parametrize("limit", [1, 10, 11, 1000])
def test_bounded_lines_skip_over_long_lines_without_holding_them(limit: int) -> None:
    # GIVEN a 5 MB line between short ones, and lines exactly at the limit
    at_limit = b"y" * 10
    source = _Spy(b"a\n" + b"x" * 5_000_000 + b"\n" + at_limit + b"\nb\n" + at_limit)
    # WHEN read with a limit
    lines = list(bounded_lines(source, limit))
    # THEN the over-long lines are None in their place and the others come back whole
    fits = limit >= 10
    tail = [at_limit + b"\n" if fits else None, b"b\n", at_limit if fits else None]
    assert lines == [b"a\n", None, *tail]
    # AND no read held more than the limit plus a bounded chunk, never the whole line
    assert source.longest <= max(limit + 1, 1 << 16)
