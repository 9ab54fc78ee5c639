"""Fan-out and fan-in: a step mapped over the rows of a variable-length tensor.

The step models are plain functions behind the runner's effects: a ``split`` model
makes rows per item (item i's rows are ``[i, k]``, k = 0..n-1) and a per-row ``double``
model doubles each row; every call is recorded, so chunks and order are exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
from pydantic import ValidationError

from spillway.models.config import ModelConfig
from spillway.models.engine import OnnxModel
from spillway.models.pipeline_schema import DEFAULT_MAX_ROWS
from spillway.models.processing import Prepared, Tensors
from spillway.pipelines.definition import Pipeline
from spillway.pipelines.graph import build_pipeline
from spillway.pipelines.runner import (
    CacheIO,
    Compute,
    Effect,
    LocalSteps,
    Outcome,
    PipelineStats,
    Resolve,
    advance,
    drive,
    run_steps,
)
from spillway.pipelines.stepcache import MemoryCache
from spillway.protocol.errors import (
    DeadlineExceededError,
    FanOutTooLargeError,
    InferenceError,
    InvalidInputError,
    ModelLoadError,
)
from spillway.state.table import scope

SLOTS = 4


def tensors(specs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": n, "data_type": t, "dims": list(d)} for n, (t, d) in specs.items()]


def config(name: str, inputs: dict[str, Any], outputs: dict[str, Any], batch: int) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": name,
            "max_batch_size": batch,
            "input": tensors(inputs),
            "output": tensors(outputs),
        }
    )


ROW = ("TYPE_FP32", [2])
CONFIGS = {
    # Flat (a pipeline that does not batch): n [items] -> rows [sum(n), 2], counts [items].
    "split": config(
        "split",
        {"n": ("TYPE_INT64", [-1])},
        {"rows": ("TYPE_FP32", [-1, 2]), "counts": ("TYPE_INT64", [-1])},
        0,
    ),
    # Padded (a pipeline that batches): n [B, 1] -> rows [B, 4, 2], counts [B, 1].
    "split-padded": config(
        "split-padded",
        {"n": ("TYPE_INT64", [1])},
        {"rows": ("TYPE_FP32", [SLOTS, 2]), "counts": ("TYPE_INT64", [1])},
        8,
    ),
    # Counts with three numbers per item.
    "split-wide": config(
        "split-wide",
        {"n": ("TYPE_INT64", [-1])},
        {"rows": ("TYPE_FP32", [-1, 2]), "counts": ("TYPE_INT64", [-1, 3])},
        0,
    ),
    "double": config("double", {"a": ROW}, {"b": ROW}, 2),
    "double-one": config(
        "double-one", {"a": ("TYPE_FP32", [1, 2])}, {"b": ("TYPE_FP32", [1, 2])}, 0
    ),
    "wide": config("wide", {"a": ("TYPE_FP32", [3])}, {"b": ROW}, 2),
    "words": config("words", {"a": ("TYPE_STRING", [2])}, {"b": ROW}, 2),
}
SERVED = {name: [1] for name in CONFIGS}


def split(t: Tensors) -> Tensors:
    n = t["n"].reshape(-1)
    rows = [[float(i), float(k)] for i, c in enumerate(n) for k in range(c)]
    return {
        "rows": np.array(rows, dtype=np.float32).reshape(-1, 2),
        "counts": n.astype(np.int64),
    }


def split_padded(t: Tensors) -> Tensors:
    n = t["n"].reshape(-1)
    rows = np.full((len(n), SLOTS, 2), -7, dtype=np.float32)  # unused slots hold junk
    for i, c in enumerate(n):
        rows[i, :c] = np.array([[i, k] for k in range(c)], dtype=np.float32).reshape(-1, 2)
    return {"rows": rows, "counts": t["n"]}


FUNCTIONS: dict[str, Callable[[Tensors], Tensors]] = {
    "split": split,
    "split-padded": split_padded,
    "double": lambda t: {"b": t["a"] * 2},
    "double-one": lambda t: {"b": t["a"] * 2},
}


class Steps:
    """Answers effects with ``FUNCTIONS``; records (model, rows per input) of each call."""

    def __init__(self) -> None:
        self.computed: list[tuple[str, list[int]]] = []

    def __call__(self, effect: Effect) -> Any:
        if isinstance(effect, Resolve):
            return 1
        if isinstance(effect, Compute):
            sizes = [len(next(iter(x.values()))) for x in effect.inputs]
            self.computed.append((effect.step.model, sizes))
            return [FUNCTIONS[effect.step.model](x) for x in effect.inputs]
        assert isinstance(effect, CacheIO)
        return effect.call()


def pipeline(
    source: str = "split",
    mapped: str = "double",
    padded: bool = False,
    *,
    over: Any = "rows",
    counts: str = "counts",
    options: dict[str, Any] | None = None,
    max_rows: int | None = None,
) -> Pipeline:
    """``n`` -> ``source`` -> rows and counts -> ``mapped`` over the rows -> ``out``."""
    mapping: dict[str, Any] = {"over": over, "counts": counts}
    if max_rows is not None:
        mapping["max_rows"] = max_rows
    document: dict[str, Any] = {
        "name": "pipe",
        "platform": "ensemble",
        "max_batch_size": 8 if padded else 0,
        "input": tensors({"n": ("TYPE_INT64", [1] if padded else [-1])}),
        "output": tensors(
            {
                "out": ("TYPE_FP32", [SLOTS if padded else -1, 2]),
                "counts": ("TYPE_INT64", [1] if padded else [-1]),
            }
        ),
        "ensemble_scheduling": {
            "step": [
                {
                    "model_name": source,
                    "input_map": {"n": "n"},
                    "output_map": {"rows": "rows", "counts": "counts"},
                },
                {
                    "model_name": mapped,
                    "input_map": {"a": over if isinstance(over, str) else "rows"},
                    "output_map": {"b": "out"},
                    "spillway": {"map": mapping, **(options or {})},
                },
            ]
        },
    }
    return build_pipeline(ModelConfig.model_validate(document), CONFIGS, SERVED)


def run(
    chain: Pipeline, *requests: Tensors, cache: MemoryCache | None = None
) -> tuple[list[Any], Steps]:
    steps = Steps()
    outcomes = drive(
        run_steps(chain, list(requests), cache, PipelineStats(), scope=scope("t")), steps
    )
    return outcomes, steps


def n(*counts: int, padded: bool = False) -> Tensors:
    array = np.array(counts, dtype=np.int64)
    return {"n": array.reshape(-1, 1) if padded else array}


def doubled_rows(counts: list[int]) -> list[list[list[float]]]:
    """Each item's expected rows: ``2 * [i, k]``."""
    return [[[2.0 * i, 2.0 * k] for k in range(c)] for i, c in enumerate(counts)]


# --- running ------------------------------------------------------------------------------


@pytest.mark.parametrize("counts", [[2], [2, 0, 3]], ids=["one-item", "three-items"])
def test_flat_rows_run_in_chunks_and_come_back_per_item_in_order(counts: list[int]) -> None:
    # GIVEN a pipeline that does not batch: its rows are flat, [sum(counts), 2]
    chain = pipeline()
    # WHEN a request of len(counts) items runs
    (outcome,), steps = run(chain, n(*counts))
    # THEN every row came back doubled, item by item, in order, with the counts
    expected = [row for item in doubled_rows(counts) for row in item]
    assert outcome.tensors["out"].tolist() == expected
    assert outcome.tensors["counts"].tolist() == counts
    # AND the per-row model got them in chunks of at most its max_batch_size (2)
    rows = sum(counts)
    assert steps.computed[1] == ("double", [2] * (rows // 2) + [1] * (rows % 2))


def test_padded_rows_come_back_in_their_items_slots() -> None:
    # GIVEN a pipeline that batches: rows are padded per item, [B, 4, 2]
    chain = pipeline("split-padded", padded=True)
    # WHEN one request of three items with 2, 0 and 3 rows runs
    (outcome,), steps = run(chain, n(2, 0, 3, padded=True))
    # THEN each item's rows are first in its slots, the rest zero (never the junk)
    out = outcome.tensors["out"]
    assert out.shape == (3, SLOTS, 2)
    for i, item in enumerate(doubled_rows([2, 0, 3])):
        assert out[i, : len(item)].tolist() == item
        assert not out[i, len(item) :].any()
    assert steps.computed[1] == ("double", [2, 2, 1])


def test_two_requests_rows_share_chunks_and_each_gets_its_own() -> None:
    # GIVEN two requests run together (as a batch job runs records)
    chain = pipeline("split-padded", padded=True)
    (first, second), steps = run(chain, n(1, padded=True), n(0, 2, padded=True))
    # THEN their 3 rows ran as chunks of 2 and 1, and each request got its own rows back
    assert steps.computed[1] == ("double", [2, 1])
    assert first.tensors["out"][0, :1].tolist() == [[0.0, 0.0]]
    assert second.tensors["out"][1, :2].tolist() == doubled_rows([0, 2])[1]
    assert not second.tensors["out"][0].any()


def test_items_without_rows_call_no_model() -> None:
    # GIVEN items that all have no rows
    (outcome,), steps = run(pipeline(), n(0, 0))
    # THEN the per-row model was never called and the output has no rows
    assert [model for model, _ in steps.computed] == ["split"]
    assert outcome.tensors["out"].shape == (0, 2)
    assert outcome.tensors["out"].dtype == np.float32
    (padded,), steps = run(pipeline("split-padded", padded=True), n(0, 0, padded=True))
    assert [model for model, _ in steps.computed] == ["split-padded"]
    assert padded.tensors["out"].shape == (2, SLOTS, 2)
    assert not padded.tensors["out"].any()


def test_a_model_that_does_not_batch_gets_the_rows_one_by_one() -> None:
    # GIVEN a per-row model without a batch dimension whose input is [1, 2]
    chain = pipeline(mapped="double-one")
    fan = chain.steps[1].fanout
    assert fan is not None
    assert fan.lead
    # WHEN three rows run THEN each went alone, and came back in order
    (outcome,), steps = run(chain, n(1, 2))
    assert steps.computed[1] == ("double-one", [1, 1, 1])
    assert outcome.tensors["out"].tolist() == [[0.0, 0.0], [2.0, 0.0], [2.0, 2.0]]


def test_rows_are_cached_one_by_one() -> None:
    # GIVEN a mapped step whose results are cached
    chain = pipeline(options={"cache": True})
    cache = MemoryCache(max_bytes=1 << 20)
    # WHEN a request runs, then one whose rows are all among those seen
    run(chain, n(2, 1), cache=cache)
    (again,), steps = run(chain, n(2), cache=cache)
    # THEN the second computed nothing for the mapped step and says it was cached
    assert [model for model, _ in steps.computed] == ["split"]
    assert again.cached == ["1:double"]
    assert again.tensors["out"].tolist() == doubled_rows([2])[0]


def test_counts_that_do_not_fit_the_rows_fail_the_request() -> None:
    # GIVEN counts a step model made that do not match its rows
    chain = pipeline()
    original = FUNCTIONS["split"]
    FUNCTIONS["split"] = lambda t: {**original(t), "counts": np.array([5], dtype=np.int64)}
    try:
        with pytest.raises(InferenceError, match="'rows' has 2 rows but counts 'counts' sum to 5"):
            run(chain, n(2))
    finally:
        FUNCTIONS["split"] = original


def test_counts_the_caller_sent_are_the_callers_error() -> None:
    document = {
        "name": "pipe",
        "platform": "ensemble",
        "max_batch_size": 0,
        "input": tensors({"rows": ("TYPE_FP32", [-1, 2]), "counts": ("TYPE_INT32", [-1, 1])}),
        "output": tensors({"out": ("TYPE_FP32", [-1, 2])}),
        "ensemble_scheduling": {
            "step": [
                {
                    "model_name": "double",
                    "input_map": {"a": "rows"},
                    "output_map": {"b": "out"},
                    "spillway": {"map": {"over": ["rows"], "counts": "counts"}},
                }
            ]
        },
    }
    chain = build_pipeline(ModelConfig.model_validate(document), CONFIGS, SERVED)
    rows = np.ones((3, 2), dtype=np.float32)
    good = {"rows": rows, "counts": np.array([[1], [2]], dtype=np.int32)}
    (outcome,), _ = run(chain, good)
    assert outcome.tensors["out"].tolist() == [[2.0, 2.0]] * 3
    bad = {"rows": rows, "counts": np.array([[-1], [4]], dtype=np.int32)}
    with pytest.raises(InvalidInputError, match="negative count"):
        run(chain, bad)


# --- loading ------------------------------------------------------------------------------


REFUSED = [
    ("unknown-rows", {"over": "nosuch"}, "maps over 'nosuch', neither an input nor made"),
    ("unknown-counts", {"counts": "nosuch"}, "map counts 'nosuch' is neither an input nor"),
    ("float-counts", {"counts": "rows"}, "map counts 'rows' is FP32, not INT32/INT64"),
    ("row-dims", {"mapped": "wide"}, "a row of 'rows' has dims [2] but wide.a takes [3]"),
    ("row-type", {"mapped": "words"}, "'rows' is FP32 but words.a takes BYTES"),
]


@pytest.mark.parametrize(
    ("change", "reason"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_a_map_that_cannot_run_is_refused_at_load(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(ModelLoadError) as error:
        pipeline(**change)
    assert error.value.message.startswith("pipeline 'pipe': step 1 (")
    assert reason in error.value.message


def test_counts_must_be_one_number_per_item() -> None:
    with pytest.raises(ModelLoadError) as error:
        pipeline("split-wide")
    assert "map counts 'counts' has dims [-1, 3]; one count per item is [-1] or [-1, 1]" in (
        error.value.message
    )


def test_the_schema_wants_the_step_to_read_exactly_what_it_maps() -> None:
    with pytest.raises(ValidationError, match=r"reads exactly the tensors of map\.over"):
        pipeline(over=["rows", "counts"])


# --- bounds: what one request may cost ------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True], ids=["flat", "padded"])
def test_a_request_over_max_rows_is_refused_before_the_step_runs(padded: bool) -> None:
    # GIVEN a mapped step that allows 4 rows per request
    chain = pipeline("split-padded" if padded else "split", padded=padded, max_rows=4)
    # WHEN a request's items would run 3 + 2 rows through it
    with pytest.raises(FanOutTooLargeError) as refused:
        run(chain, n(3, 2, padded=padded))
    # THEN it is refused, 413 fanout_too_large, naming the step, the rows and the limit
    assert (refused.value.status, refused.value.code) == (413, "fanout_too_large")
    assert refused.value.message == (
        "step 1:double of pipeline 'pipe' would run 5 rows for this request; it allows at "
        "most 4 per request"
    )
    # AND the mapped step's model never ran (only the step that made the rows did)
    steps = Steps()
    with pytest.raises(FanOutTooLargeError):
        drive(run_steps(chain, [n(3, 2, padded=padded)], None, PipelineStats(), scope=None), steps)
    assert [model for model, _ in steps.computed] == ["split-padded" if padded else "split"]


def test_a_request_at_max_rows_runs() -> None:
    # GIVEN a mapped step that allows 4 rows per request
    # WHEN a request runs exactly 4 THEN it gets every row back
    (outcome,), _ = run(pipeline(max_rows=4), n(3, 1))
    assert outcome.tensors["out"].tolist() == [row for item in doubled_rows([3, 1]) for row in item]


def test_each_request_of_a_run_is_bounded_on_its_own() -> None:
    # GIVEN a step allowing 4 rows a request, and two requests of 3 rows run together (a
    # batch job's records): 6 rows in all, each request within its bound
    (first, second), _ = run(pipeline(max_rows=4), n(3), n(1, 2))
    # THEN both ran
    assert first.tensors["out"].shape == (3, 2)
    assert second.tensors["out"].shape == (3, 2)


def test_a_mapped_step_without_max_rows_allows_the_default() -> None:
    chain = pipeline()
    fan = chain.steps[1].fanout
    assert fan is not None
    assert fan.max_rows == DEFAULT_MAX_ROWS == 256
    with pytest.raises(FanOutTooLargeError, match="would run 257 rows"):
        run(chain, n(200, 57))


def test_the_chained_path_refuses_the_same_fan_out() -> None:
    # GIVEN the mapped step of a pipeline run one step per call (the Step Functions form,
    # which runs each step through ``advance``) and a state whose counts exceed its bound
    chain = pipeline(max_rows=4)
    state = dict(n(5))
    state.update(split(state))
    # WHEN that step runs THEN it is refused before any chunk is computed
    steps = Steps()
    with pytest.raises(FanOutTooLargeError):
        drive(
            advance(chain.steps[1], [state], [Outcome({})], None, PipelineStats(), scope=None),
            steps,
        )
    assert steps.computed == []


def test_the_schema_bounds_max_rows() -> None:
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        pipeline(max_rows=0)


# --- bounds: a request's whole run stops at its deadline -----------------------------------


class Clocked:
    """A step model behind ``LocalSteps``: each run takes one second of ``clock``."""

    def __init__(self, name: str, clock: list[float]) -> None:
        self.name, self.version, self.clock = name, 1, clock
        self.runs = 0

    def prepare_many(self, inputs: list[Tensors]) -> list[Prepared]:
        return [Prepared(dict(x), len(next(iter(x.values())))) for x in inputs]

    def run(self, prepared: list[Prepared]) -> list[Tensors]:
        self.runs += 1
        self.clock[0] += 1.0
        return [FUNCTIONS[self.name](p.feeds) for p in prepared]


def test_a_mapped_step_stops_at_the_deadline_between_chunks() -> None:
    # GIVEN a pipeline whose mapped step runs 10 rows in chunks of 2 (5 runs), each run
    # taking a second, and a request whose deadline is 3.5 s away
    clock = [0.0]
    models = {name: Clocked(name, clock) for name in ("split", "double")}
    steps = LocalSteps(lambda name, _: cast(OnnxModel, models[name]), 3.5, lambda: clock[0])
    # WHEN it runs
    with pytest.raises(DeadlineExceededError, match="chunk 4 of 5 of step 1:double"):
        drive(run_steps(pipeline(), [n(10)], None, PipelineStats(), scope=None), steps)
    # THEN the work stopped there: split ran at 0 s, chunks at 1, 2 and 3 s; none after
    assert (models["split"].runs, models["double"].runs) == (1, 3)


def test_a_pipeline_bounds_the_timeout_a_request_asks_for() -> None:
    chain = pipeline()
    # GIVEN the default bound of a pipeline's run (60 s)
    assert chain.timeout_s == 60.0
    # THEN a request's own timeout may only lower it; none gets the pipeline's
    assert chain.deadline_after(5.0) == 5.0
    assert chain.deadline_after(3600.0) == 60.0
    assert chain.deadline_after(None) == 60.0
