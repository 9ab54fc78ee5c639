"""One shard through a fake model: batching, order, isolation of bad records, .npy, and a
staged infer request's rows."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_job.npyshard import process_npy
from batch_job.recordshard import process_jsonl, process_staged
from batch_job.shard import ShardCounts
from spillway.protocol.codec import encode_request
from spillway.protocol.messages import stage_request
from tests.unit.test_jobs_fakes import FakeModel, line

Lines = list[dict[str, Any]]


def _parse(text: str) -> Lines:
    return [json.loads(x) for x in text.splitlines()]


def _run(
    lines: list[str],
    tmp_path: Path,
    batch_size: int = 4,
    model: FakeModel | None = None,
    max_record_bytes: int = 1 << 20,
) -> tuple[FakeModel, ShardCounts, Lines, Lines, list[tuple[int, int]]]:
    model = model or FakeModel()
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    outputs, errors = io.StringIO(), io.StringIO()
    progress: list[tuple[int, int]] = []
    counts = process_jsonl(
        model,
        source,
        outputs,
        errors,
        batch_size,
        lambda r, e: progress.append((r, e)),
        max_record_bytes=max_record_bytes,
    )
    return model, counts, _parse(outputs.getvalue()), _parse(errors.getvalue()), progress


def test_records_run_in_full_batches_and_come_out_in_order(tmp_path: Path) -> None:
    # GIVEN 10 good records and a batch size of 4
    lines = [line(f"r{i}", [i, 0.5]) for i in range(10)]
    # WHEN the shard runs
    model, counts, outputs, errors, progress = _run(lines, tmp_path)
    # THEN runs are 4, 4, 2 rows and outputs are in input order with their own values
    assert model.runs == [4, 4, 2]
    assert [o["id"] for o in outputs] == [f"r{i}" for i in range(10)]
    assert [o["outputs"]["y"] for o in outputs] == [[i + 0.5] for i in range(10)]
    assert (counts.records, counts.outputs, counts.errors, counts.batches) == (10, 10, 0, 3)
    assert errors == []
    # AND progress was reported per batch and adds up
    assert sum(r for r, _ in progress) == 10


def test_a_poison_record_fails_alone_after_its_batch_is_retried(tmp_path: Path) -> None:
    # GIVEN a batch of four holding one record the runtime fails on
    lines = [line("a", [1, 1]), line("b", [2, 2]), line("poison", [-1, 0]), line("c", [3, 3])]
    # WHEN the shard runs
    model, counts, outputs, errors, _ = _run(lines, tmp_path)
    # THEN the batch failed once, was rerun record by record, and only the poison failed
    assert model.runs == [4, 1, 1, 1, 1]
    assert [(o["id"], o["outputs"]["y"]) for o in outputs] == [
        ("a", [2.0]),
        ("b", [4.0]),
        ("c", [6.0]),
    ]
    assert errors == [
        {"id": "poison", "error": "poison row in batch", "code": "inference_failed", "line": 3}
    ]
    assert (counts.batch_failures, counts.outputs, counts.errors) == (1, 3, 1)


def test_bad_lines_go_to_errors_and_never_join_a_batch(tmp_path: Path) -> None:
    # GIVEN good records among every kind of bad line
    bad = {
        "{oops": (None, "not valid JSON"),
        "[1, 2]": (None, "JSON object"),
        json.dumps({"id": 5, "data": {"x": [1, 2]}}): (None, "'id' string"),
        json.dumps({"id": "no-data"}): ("no-data", "'data' object"),
        line("ragged", [[1], [1, 2]]): ("ragged", "rectangular"),
        line("words", ["a", "b"]): ("words", "FP32"),
        line("bools", [True, False]): ("bools", "FP32"),
        line("huge", [1e39, 0]): ("huge", "NaN or an infinity"),
        line("short", [1.0]): ("short", "[-1, 2]"),
        json.dumps({"id": "extra", "data": {"x": [1, 2], "z": [1]}}): ("extra", "unknown input"),
    }
    lines = [line("first", [1, 2]), *bad, "", line("last", [3, 4])]
    # WHEN the shard runs
    model, counts, outputs, errors, _ = _run(lines, tmp_path)
    # THEN only the two good records ran, in one batch
    assert model.runs == [2]
    assert [o["id"] for o in outputs] == ["first", "last"]
    # AND every bad line is reported once, in order, with its id (if any), line and reason
    assert [(e["id"], e["line"], e["code"]) for e in errors] == [
        (want_id, number, "non_finite_input" if want_id == "huge" else "invalid_input")
        for number, (want_id, _) in enumerate(bad.values(), start=2)
    ]
    for error, (_, reason) in zip(errors, bad.values(), strict=True):
        assert reason in error["error"]
    # AND the blank line is not a record
    assert (counts.records, counts.outputs, counts.errors) == (12, 2, 10)


def test_an_over_long_line_is_an_error_record_and_the_shard_goes_on(tmp_path: Path) -> None:
    # GIVEN a 200 kB record between good ones, and a limit of 100 kB
    big = line("big", [1.0] * 20_000)
    lines = [line("a", [1, 2]), big, line("b", [3, 4])]
    # WHEN the shard runs
    _, counts, outputs, errors, _ = _run(lines, tmp_path, max_record_bytes=100_000)
    # THEN the long line is a payload_too_large error at line 2; the others ran
    assert [o["id"] for o in outputs] == ["a", "b"]
    assert [(e["id"], e["line"], e["code"]) for e in errors] == [(None, 2, "payload_too_large")]
    assert "100000 bytes" in errors[0]["error"]
    assert (counts.records, counts.outputs, counts.errors) == (3, 2, 1)


def test_a_repeated_id_is_an_error_and_only_the_first_record_runs(tmp_path: Path) -> None:
    # GIVEN ids "a" three times (the first a poison record) and "b" twice
    lines = [line("a", [-1, 0]), line("b", [1, 1]), line("a", [1, 2]), line("b", [2, 2])]
    lines.append(line("a", [3, 3]))
    # WHEN the shard runs
    _, counts, outputs, errors, _ = _run(lines, tmp_path)
    # THEN only the first "b" has an output; the first "a" failed on its own
    assert [(o["id"], o["outputs"]["y"]) for o in outputs] == [("b", [2.0])]
    assert [(e["id"], e["line"], e["code"]) for e in errors] == [
        ("a", 1, "inference_failed"),
        ("a", 3, "duplicate_id"),
        ("b", 4, "duplicate_id"),
        ("a", 5, "duplicate_id"),
    ]
    assert "'a'" in errors[1]["error"]
    # AND the counts still add up, the duplicates counted as errors
    assert (counts.records, counts.outputs, counts.errors) == (5, 1, 4)


RECORDS = st.lists(st.sampled_from(["good", "poison", "broken", "wrong-shape"]), max_size=30)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(kinds=RECORDS, batch_size=st.integers(min_value=1, max_value=5))
def test_every_record_appears_exactly_once(
    kinds: list[str], batch_size: int, tmp_path: Path
) -> None:
    # GIVEN any mix of good, poison, unparseable and wrongly shaped records
    lines = []
    for i, kind in enumerate(kinds):
        value: Any = {"good": [i, 1], "poison": [-1, i], "wrong-shape": [i]}.get(kind)
        broken = f'{{"id": "r{i}", "data": '
        lines.append(broken if kind == "broken" else line(f"r{i}", value))
    model = FakeModel()
    # WHEN the shard runs with any batch size
    _, counts, outputs, errors, _ = _run(lines, tmp_path, batch_size, model)
    # THEN each record is exactly once in outputs or errors; outputs keep input order
    good = [f"r{i}" for i, k in enumerate(kinds) if k == "good"]
    assert [o["id"] for o in outputs] == good
    assert [o["outputs"]["y"] for o in outputs] == [
        [float(i + 1)] for i, k in enumerate(kinds) if k == "good"
    ]
    assert len(errors) == len(kinds) - len(good)
    assert counts.records == counts.outputs + counts.errors == len(kinds)
    # AND no run exceeds the batch size
    assert all(rows <= batch_size for rows in model.runs)


def _npy(
    tmp_path: Path, array: np.ndarray, batch_size: int = 4, allow_pickle: bool = False
) -> tuple[FakeModel, ShardCounts, dict[str, np.ndarray], Lines]:
    source = tmp_path / "in.npy"
    np.save(source, array, allow_pickle=allow_pickle)
    errors = io.StringIO()
    model = FakeModel()
    counts = process_npy(model, source, tmp_path / "part", errors, batch_size, lambda r, e: None)
    arrays = {
        name: np.load(tmp_path / f"part.{name}.npy", allow_pickle=False)
        for name in ("rows", "out-y")
    }
    return model, counts, arrays, _parse(errors.getvalue())


def test_npy_rows_run_in_chunks_and_a_poison_row_is_isolated(tmp_path: Path) -> None:
    # GIVEN 10 float64 rows (castable to FP32), row 5 poisonous
    array = np.stack([np.arange(10.0), np.ones(10)], axis=1)
    array[5, 0] = -1
    # WHEN the shard runs in chunks of 4
    model, counts, arrays, errors = _npy(tmp_path, array)
    # THEN the chunk holding row 5 was rerun row by row, and only row 5 failed
    assert model.runs == [4, 4, 1, 1, 1, 1, 2]
    np.testing.assert_array_equal(arrays["rows"], [0, 1, 2, 3, 4, 6, 7, 8, 9])
    np.testing.assert_array_equal(arrays["out-y"][:, 0], [1, 2, 3, 4, 5, 7, 8, 9, 10])
    assert errors == [
        {"id": "5", "error": "poison row in batch", "code": "inference_failed", "row": 5}
    ]
    assert (counts.records, counts.outputs, counts.errors, counts.batch_failures) == (10, 9, 1, 1)


def test_npy_of_the_wrong_shape_fails_every_row(tmp_path: Path) -> None:
    # GIVEN rows of 3 values for a model that takes 2
    model, counts, arrays, errors = _npy(tmp_path, np.zeros((5, 3), np.float32))
    # THEN nothing ran and every row is an error
    assert model.runs == []
    assert [e["row"] for e in errors] == [0, 1, 2, 3, 4]
    assert arrays["out-y"].shape == (0, 1)
    assert (counts.records, counts.errors) == (5, 5)


def test_npy_object_arrays_are_refused_without_unpickling(tmp_path: Path) -> None:
    # GIVEN an object array (its .npy holds a pickle)
    array = np.array([{"a": 1}, None], dtype=object)
    # WHEN the shard runs
    model, counts, arrays, errors = _npy(tmp_path, array, allow_pickle=True)
    # THEN the file is one failed record and nothing was loaded or run
    assert model.runs == []
    assert (counts.records, counts.errors) == (1, 1)
    assert errors[0]["id"] is None
    assert "not a readable .npy" in errors[0]["error"]
    assert arrays["rows"].shape == (0,)


def _staged(
    tmp_path: Path, data: bytes, batch_size: int = 4, model: FakeModel | None = None
) -> tuple[FakeModel, ShardCounts, Lines, Lines]:
    model = model or FakeModel()
    source = tmp_path / "request.v2req"
    source.write_bytes(data)
    outputs, errors = io.StringIO(), io.StringIO()
    counts = process_staged(model, source, outputs, errors, batch_size, lambda r, e: None)
    return model, counts, _parse(outputs.getvalue()), _parse(errors.getvalue())


def _request(x: np.ndarray, binary: bool) -> bytes:
    return stage_request(*encode_request({"x": x}, binary=binary))


def test_a_staged_request_runs_row_by_row_as_records(tmp_path: Path) -> None:
    # GIVEN a staged JSON infer request of 6 rows, row 2 poisonous
    x = np.stack([np.arange(6, dtype=np.float32), np.ones(6, np.float32)], axis=1)
    x[2, 0] = -1
    # WHEN the shard runs in batches of 4
    model, counts, outputs, errors = _staged(tmp_path, _request(x, binary=False))
    # THEN rows are records "0".."5" run like JSON Lines records: the failed batch was
    # rerun row by row and only row 2 failed, placed by its row
    assert model.runs == [4, 1, 1, 1, 1, 2]
    assert [(o["id"], o["outputs"]["y"]) for o in outputs] == [
        (str(i), [i + 1.0]) for i in (0, 1, 3, 4, 5)
    ]
    assert errors == [
        {"id": "2", "error": "poison row in batch", "code": "inference_failed", "row": 2}
    ]
    assert (counts.records, counts.outputs, counts.errors, counts.batch_failures) == (6, 5, 1, 1)


def test_a_binary_staged_request_gives_the_same_outputs_as_json(tmp_path: Path) -> None:
    # GIVEN the same rows staged as JSON and as Triton's binary extension
    x = np.random.default_rng(1).uniform(0, 5, (9, 2)).astype(np.float32)
    (tmp_path / "json").mkdir()
    (tmp_path / "binary").mkdir()
    # WHEN both run
    from_json = _staged(tmp_path / "json", _request(x, binary=False), batch_size=3)
    from_binary = _staged(tmp_path / "binary", _request(x, binary=True), batch_size=3)
    # THEN the outputs are equal, and equal to the sums, with no errors
    assert from_binary[2] == from_json[2]
    np.testing.assert_allclose([o["outputs"]["y"][0] for o in from_json[2]], x.sum(axis=1))
    assert (from_json[3], from_binary[3]) == ([], [])
    assert from_json[0].runs == from_binary[0].runs == [3, 3, 3]


def test_rows_of_the_wrong_shape_fail_one_by_one(tmp_path: Path) -> None:
    # GIVEN a staged request whose rows have 3 values for a model that takes 2
    _, counts, outputs, errors = _staged(tmp_path, _request(np.zeros((3, 3), np.float32), False))
    # THEN each row is an error of its own, placed by its row
    assert outputs == []
    assert [(e["id"], e["row"], e["code"]) for e in errors] == [
        (str(i), i, "invalid_input") for i in range(3)
    ]
    assert (counts.records, counts.errors) == (3, 3)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b'{"inputs": []}', "not a staged infer request"),
        (stage_request(b"{not json", None), "invalid JSON"),
        (stage_request(b'{"inputs": [{"name": "x"}]}', None), "invalid inference request"),
        (
            stage_request(*encode_request({"x": np.zeros((2, 2), np.float32)}, binary=True))[:-4],
            "runs past the end",
        ),
        (
            stage_request(
                *encode_request(
                    {"x": np.zeros((2, 2), np.float32), "z": np.zeros((3, 2), np.float32)},
                    binary=False,
                )
            ),
            "same batch size",
        ),
    ],
)
def test_a_request_that_cannot_be_decoded_is_one_failed_record(
    data: bytes, reason: str, tmp_path: Path
) -> None:
    # WHEN an unreadable staged request runs
    model, counts, outputs, errors = _staged(tmp_path, data)
    # THEN nothing ran, and the file is one error without id or place
    assert (model.runs, outputs) == ([], [])
    assert len(errors) == 1
    assert (errors[0]["id"], errors[0]["code"], "row" in errors[0]) == (
        None,
        "invalid_input",
        False,
    )
    assert reason in errors[0]["error"]
    assert (counts.records, counts.outputs, counts.errors) == (1, 0, 1)


ROWS = st.lists(st.integers(min_value=-3, max_value=9), max_size=25)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(values=ROWS, batch_size=st.integers(min_value=1, max_value=5), binary=st.booleans())
def test_every_staged_row_appears_exactly_once(
    values: list[int], batch_size: int, binary: bool, tmp_path: Path
) -> None:
    # GIVEN a staged request of any rows, negative ones poisonous, in either encoding
    x = np.array([[v, 1] for v in values], np.float32).reshape(len(values), 2)
    model = FakeModel()
    # WHEN it runs with any batch size
    _, counts, outputs, errors = _staged(tmp_path, _request(x, binary), batch_size, model)
    # THEN each row is once in outputs (in order, its own value) or errors, by its index
    good = [i for i, v in enumerate(values) if v >= 0]
    assert [o["id"] for o in outputs] == [str(i) for i in good]
    assert [o["outputs"]["y"] for o in outputs] == [[values[i] + 1.0] for i in good]
    assert [e["row"] for e in errors] == [i for i, v in enumerate(values) if v < 0]
    assert counts.records == counts.outputs + counts.errors == len(values)
    assert all(rows <= batch_size for rows in model.runs)
