"""One shard through a fake model: batching, order, isolation of bad records, .npy."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_job.jsonlshard import process_jsonl
from batch_job.npyshard import process_npy
from batch_job.shard import ShardCounts
from tests.unit.test_jobs_fakes import FakeModel, line

Lines = list[dict[str, Any]]


def _parse(text: str) -> Lines:
    return [json.loads(x) for x in text.splitlines()]


def _run(
    lines: list[str], tmp_path: Path, batch_size: int = 4, model: FakeModel | None = None
) -> tuple[FakeModel, ShardCounts, Lines, Lines, list[tuple[int, int]]]:
    model = model or FakeModel()
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    outputs, errors = io.StringIO(), io.StringIO()
    progress: list[tuple[int, int]] = []
    counts = process_jsonl(
        model, source, outputs, errors, batch_size, lambda r, e: progress.append((r, e))
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
        line("huge", [1e39, 0]): ("huge", "out of range"),
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
        (want_id, number, "invalid_input")
        for number, (want_id, _) in enumerate(bad.values(), start=2)
    ]
    for error, (_, reason) in zip(errors, bad.values(), strict=True):
        assert reason in error["error"]
    # AND the blank line is not a record
    assert (counts.records, counts.outputs, counts.errors) == (12, 2, 10)


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
