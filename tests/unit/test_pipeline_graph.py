"""Pipelines: the definition is checked at load, the step runner runs it (no I/O here).

The step models are plain functions behind the runner's effects, so every case is exact:
what each step computed, which steps were skipped, what came from the cache.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from spillway.models.config import ModelConfig
from spillway.models.pipeline_schema import StepCondition
from spillway.models.processing import Tensors
from spillway.pipelines.definition import check_inputs, condition_holds
from spillway.pipelines.graph import build_pipeline
from spillway.pipelines.runner import (
    CacheIO,
    Compute,
    Effect,
    PipelineStats,
    Resolve,
    drive,
    run_steps,
)
from spillway.pipelines.stepcache import MemoryCache
from spillway.protocol.errors import BatchTooLargeError, InvalidInputError, ModelLoadError
from spillway.state.table import scope

Model = Callable[[Tensors], Tensors]
A, B = scope("tenant-a"), scope("tenant-b")
"""Two tenants' scopes, as the router names them."""


def model_config(
    name: str, inputs: dict[str, Any], outputs: dict[str, Any], batch: int = 8
) -> ModelConfig:
    """A tensor model's configuration: ``{"name": ("TYPE_FP32", [dims])}`` per tensor."""

    def tensors(specs: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"name": n, "data_type": t, "dims": list(d)} for n, (t, d) in specs.items()]

    return ModelConfig.model_validate(
        {
            "name": name,
            "max_batch_size": batch,
            "input": tensors(inputs),
            "output": tensors(outputs),
        }
    )


def pipeline_config(steps: list[dict[str, Any]], **overrides: Any) -> ModelConfig:
    """``x`` FP32 [2] in, ``out`` FP32 [2] out, over ``steps``."""
    document: dict[str, Any] = {
        "name": "pipe",
        "platform": "ensemble",
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [2]}],
        "output": [{"name": "out", "data_type": "TYPE_FP32", "dims": [2]}],
        "ensemble_scheduling": {"step": steps},
    }
    document.update(overrides)
    return ModelConfig.model_validate(document)


def step(
    model: str, inputs: dict[str, str], outputs: dict[str, str], **options: Any
) -> dict[str, Any]:
    entry: dict[str, Any] = {"model_name": model, "input_map": inputs, "output_map": outputs}
    if options:
        entry["spillway"] = options
    return entry


VECTOR = ("TYPE_FP32", [2])
CONFIGS = {
    "double": model_config("double", {"a": VECTOR}, {"b": VECTOR}),
    "plus-one": model_config("plus-one", {"a": VECTOR}, {"b": VECTOR}),
    "score": model_config("score", {"a": VECTOR}, {"s": ("TYPE_FP32", [1])}),
    "words": model_config("words", {"t": ("TYPE_STRING", [1])}, {"b": VECTOR}),
    "wide": model_config("wide", {"a": ("TYPE_FP32", [3])}, {"b": VECTOR}),
    "small": model_config("small", {"a": VECTOR}, {"b": VECTOR}, batch=2),
}
SERVED = {name: [1, 2] for name in CONFIGS}
FUNCTIONS: dict[str, Model] = {
    "double": lambda t: {"b": t["a"] * 2},
    "plus-one": lambda t: {"b": t["a"] + 1},
    "score": lambda t: {"s": t["a"].sum(axis=1, keepdims=True)},
}
CHAIN = [
    step("double", {"a": "x"}, {"b": "doubled"}),
    step("plus-one", {"a": "doubled"}, {"b": "out"}),
]


class Steps:
    """Answers the runner's effects with ``FUNCTIONS``, recording every call."""

    def __init__(self, versions: dict[str, int] | None = None) -> None:
        self.versions = versions or {}
        self.computed: list[tuple[str, int]] = []  # (model, requests in the call)

    def __call__(self, effect: Effect) -> Any:
        if isinstance(effect, Resolve):
            return self.versions.get(effect.step.model, 1)
        if isinstance(effect, Compute):
            self.computed.append((effect.step.model, len(effect.inputs)))
            return [FUNCTIONS[effect.step.model](x) for x in effect.inputs]
        assert isinstance(effect, CacheIO)
        return effect.call()


def x(*rows: list[float]) -> Tensors:
    return {"x": np.array(rows, dtype=np.float32)}


# --- loading --------------------------------------------------------------------------


def test_a_chain_loads_and_runs_in_dependency_order() -> None:
    # GIVEN a chain listed out of order (the reader before the writer)
    config = pipeline_config(list(reversed(CHAIN)))
    # WHEN it loads
    pipeline = build_pipeline(config, CONFIGS, SERVED)
    # THEN the writer runs first, and the result is (x * 2) + 1
    assert [s.model for s in pipeline.steps] == ["double", "plus-one"]
    steps = Steps()
    outcome = drive(run_steps(pipeline, [x([1, 2])], None, PipelineStats(), scope=A), steps)[0]
    np.testing.assert_array_equal(outcome.tensors["out"], [[3, 5]])
    assert outcome.skipped == []
    assert steps.computed == [("double", 1), ("plus-one", 1)]


BAD = [
    (
        "unknown model",
        [step("nosuch", {"a": "x"}, {"b": "out"})],
        "step 0 (nosuch): unknown model 'nosuch'",
    ),
    (
        "unserved version",
        [{**step("double", {"a": "x"}, {"b": "out"}), "model_version": 3}],
        "version 3 of 'double' is not served",
    ),
    (
        "datatype mismatch",
        [step("words", {"t": "x"}, {"b": "out"})],
        "'x' is FP32 but words.t takes BYTES",
    ),
    (
        "shape mismatch",
        [step("wide", {"a": "x"}, {"b": "out"})],
        "'x' has dims [2] but wide.a takes [3]",
    ),
    (
        "unfed input",
        [step("double", {"zz": "x"}, {"b": "out"})],
        "input 'a' of 'double' is not mapped",
    ),
    (
        "unknown output",
        [step("double", {"a": "x"}, {"nope": "out"})],
        "'double' has no output 'nope'",
    ),
    (
        "tensor nothing makes",
        [step("double", {"a": "ghost"}, {"b": "out"})],
        "tensor 'ghost' is neither an input nor made by a step",
    ),
    (
        "cycle",
        [
            step("double", {"a": "looped"}, {"b": "out"}),
            step("plus-one", {"a": "out"}, {"b": "looped"}),
        ],
        "steps 0:double, 1:plus-one read each other's outputs in a cycle",
    ),
    (
        "output made by no step",
        [step("double", {"a": "x"}, {"b": "other"})],
        "output 'out' is made by no step",
    ),
    (
        "batch larger than a step's",
        [step("small", {"a": "x"}, {"b": "out"})],
        "max_batch_size 8 exceeds 'small''s 2",
    ),
    (
        "condition on a missing tensor",
        [
            step(
                "double", {"a": "x"}, {"b": "out"}, condition={"tensor": "s", "op": ">", "value": 1}
            )
        ],
        "the condition reads unknown tensor 's'",
    ),
    (
        "condition element past the row",
        [
            step("double", {"a": "x"}, {"b": "out"}),
            step(
                "score",
                {"a": "x"},
                {"s": "s"},
                condition={"tensor": "x", "op": ">", "value": 0, "element": 2},
            ),
        ],
        "reads element 2 of 'x', which has 2 per row",
    ),
]


@pytest.mark.parametrize(("steps", "reason"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_pipeline_is_refused_with_its_reason(
    steps: list[dict[str, Any]], reason: str
) -> None:
    # GIVEN a pipeline with one mistake
    config = pipeline_config(steps)
    # WHEN it loads THEN the error names the pipeline and the mistake
    with pytest.raises(ModelLoadError) as error:
        build_pipeline(config, CONFIGS, SERVED)
    assert error.value.message.startswith("pipeline 'pipe': ")
    assert reason in error.value.message


def test_an_unread_input_and_a_nested_pipeline_are_refused() -> None:
    two_inputs = pipeline_config(
        [step("double", {"a": "x"}, {"b": "out"})],
        input=[
            {"name": "x", "data_type": "TYPE_FP32", "dims": [2]},
            {"name": "spare", "data_type": "TYPE_FP32", "dims": [2]},
        ],
    )
    with pytest.raises(ModelLoadError, match="input 'spare' is read by no step"):
        build_pipeline(two_inputs, CONFIGS, SERVED)
    inner = pipeline_config(CHAIN).model_copy(update={"name": "inner"})
    outer = pipeline_config([step("inner", {"x": "x"}, {"out": "out"})])
    with pytest.raises(ModelLoadError, match="'inner' is a pipeline"):
        build_pipeline(outer, {**CONFIGS, "inner": inner}, {**SERVED, "inner": [1]})


def test_the_schema_refuses_what_one_configuration_shows() -> None:
    # A tensor made twice, and steps on a model that is not a pipeline.
    with pytest.raises(ValidationError, match="produced by two steps"):
        pipeline_config(
            [step("double", {"a": "x"}, {"b": "out"}), step("plus-one", {"a": "x"}, {"b": "out"})]
        )
    with pytest.raises(ValidationError, match="ensemble_scheduling goes with platform"):
        pipeline_config(CHAIN, platform="onnxruntime_onnx")
    with pytest.raises(ValidationError, match="model_version"):
        pipeline_config([{**CHAIN[0], "model_version": 0}, CHAIN[1]])


def test_requests_are_checked_against_the_pipeline_signature() -> None:
    config = pipeline_config(CHAIN)
    assert check_inputs(config, x([1, 2], [3, 4])) == 2
    with pytest.raises(InvalidInputError, match="unknown input 'y'"):
        check_inputs(config, {**x([1, 2]), "y": np.zeros((1, 2), np.float32)})
    with pytest.raises(InvalidInputError, match="must be FP32"):
        check_inputs(config, {"x": np.zeros((1, 2), np.int64)})
    with pytest.raises(InvalidInputError, match=r"must have shape \[-1, 2\]"):
        check_inputs(config, {"x": np.zeros((1, 3), np.float32)})
    with pytest.raises(BatchTooLargeError):
        check_inputs(config, {"x": np.zeros((9, 2), np.float32)})


# --- conditions -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("condition", "expected"),
    [
        ({"tensor": "s", "op": ">", "value": 0.5}, True),  # max of a row passes in row 1
        ({"tensor": "s", "op": ">", "value": 0.5, "rows": "all"}, False),
        ({"tensor": "s", "op": "<", "value": 0.5, "reduce": "min", "rows": "all"}, True),
        ({"tensor": "s", "op": ">=", "value": 0.9, "element": 1}, True),
        ({"tensor": "s", "op": ">=", "value": 0.9, "element": 0}, False),
        ({"tensor": "s", "op": "<=", "value": 0.35, "reduce": "mean", "rows": "all"}, False),
    ],
)
def test_a_condition_reads_one_number_per_row(condition: dict[str, Any], expected: bool) -> None:
    scores = np.array([[0.1, 0.2], [0.3, 0.95]], dtype=np.float32)
    assert condition_holds(StepCondition.model_validate(condition), scores, True) is expected


def test_a_failed_condition_skips_its_step_and_what_reads_from_it() -> None:
    # GIVEN: score = sum(x); "double" runs only when the score passes 10; "plus-one"
    # reads what "double" makes; the output comes from "plus-one"
    config = pipeline_config(
        [
            step("score", {"a": "x"}, {"s": "s"}),
            step(
                "double",
                {"a": "x"},
                {"b": "doubled"},
                condition={"tensor": "s", "op": ">", "value": 10},
            ),
            step("plus-one", {"a": "doubled"}, {"b": "out"}),
        ]
    )
    pipeline = build_pipeline(config, CONFIGS, SERVED)
    stats = PipelineStats()
    steps = Steps()
    # WHEN a low-score and a high-score request run together
    low, high = drive(run_steps(pipeline, [x([1, 2]), x([5, 6])], None, stats, scope=A), steps)
    # THEN the low one skipped both dependent steps and made no output; the high one ran all
    assert low.skipped == ["1:double", "2:plus-one"]
    assert low.tensors == {}
    assert high.skipped == []
    np.testing.assert_array_equal(high.tensors["out"], [[11, 13]])
    assert steps.computed == [("score", 2), ("double", 1), ("plus-one", 1)]
    assert (stats.step(1).skipped, stats.step(1).runs, stats.step(2).skipped) == (1, 1, 1)


# --- the cache ------------------------------------------------------------------------


def cached_chain() -> list[dict[str, Any]]:
    return [{**CHAIN[0], "spillway": {"cache": True}}, CHAIN[1]]


def test_a_cached_step_computes_each_input_once_per_version() -> None:
    # GIVEN a chain whose first step is cached, and a memory cache
    pipeline = build_pipeline(pipeline_config(cached_chain()), CONFIGS, SERVED)
    cache, stats = MemoryCache(1 << 20), PipelineStats()
    steps = Steps({"double": 1})

    def once(*requests: Tensors) -> list[list[str]]:
        outcomes = drive(run_steps(pipeline, list(requests), cache, stats, scope=A), steps)
        return [o.cached for o in outcomes]

    # WHEN the same input comes twice, beside a new one, then after a new version
    assert once(x([1, 2])) == [[]]
    assert once(x([1, 2]), x([7, 8])) == [["0:double"], []]
    steps.versions["double"] = 2
    assert once(x([1, 2])) == [[]]
    # THEN version 1's entry was used once, and version 2 computed its own
    assert [c for c in steps.computed if c[0] == "double"] == [("double", 1)] * 3
    assert (stats.step(0).cache_hits, stats.step(0).cache_misses) == (1, 3)
    assert stats.step(1).cache_hits == 0  # an uncached step never looks


def test_a_cache_hit_equals_the_computed_result() -> None:
    pipeline = build_pipeline(pipeline_config(cached_chain()), CONFIGS, SERVED)
    cache = MemoryCache(1 << 20)
    first = drive(run_steps(pipeline, [x([1, 2])], cache, PipelineStats(), scope=A), Steps())[0]
    again = drive(run_steps(pipeline, [x([1, 2])], cache, PipelineStats(), scope=A), Steps())[0]
    assert again.cached == ["0:double"]
    np.testing.assert_array_equal(first.tensors["out"], again.tensors["out"])


def test_one_tenants_entries_are_never_anothers_hits() -> None:
    # GIVEN a cached step, one cache for every caller, and tenant A's request answered
    pipeline = build_pipeline(pipeline_config(cached_chain()), CONFIGS, SERVED)
    cache, stats, steps = MemoryCache(1 << 20), PipelineStats(), Steps()

    def ask(owner: str | None) -> list[str]:
        return drive(run_steps(pipeline, [x([1, 2])], cache, stats, scope=owner), steps)[0].cached

    assert ask(A) == []
    # WHEN tenant B, an anonymous caller and a run of no known tenant send the same input
    answers = [ask(B), ask("-"), ask(None)]
    # THEN none of them is told of (or served) A's entry: each step was computed again
    assert answers == [[], [], []]
    assert steps.computed.count(("double", 1)) == 4
    # AND A's own repeat, and then B's, are hits in their own entries (the unknown
    # tenant's run wrote none)
    assert (ask(A), ask(B)) == (["0:double"], ["0:double"])
    assert len(cache) == 3  # A's, B's and the anonymous caller's


PUBLIC = [
    step("double", {"a": "labels"}, {"b": "label_vectors"}, cache=True, cache_scope="shared"),
    step("plus-one", {"a": "x"}, {"b": "out"}),
    step("plus-one", {"a": "label_vectors"}, {"b": "ignored"}),
]


def public_config(steps: list[dict[str, Any]], public: list[str]) -> ModelConfig:
    """``x`` (a tenant's) and ``labels`` (public when listed) in."""
    scheduling = {"step": steps, "spillway": {"public_inputs": public}}
    inputs = [
        {"name": "x", "data_type": "TYPE_FP32", "dims": [2]},
        {"name": "labels", "data_type": "TYPE_FP32", "dims": [2]},
    ]
    outputs = [
        {"name": "out", "data_type": "TYPE_FP32", "dims": [2]},
        {"name": "ignored", "data_type": "TYPE_FP32", "dims": [2]},
    ]
    return pipeline_config([], input=inputs, output=outputs, ensemble_scheduling=scheduling)


def test_a_step_on_public_inputs_may_share_its_cache_and_no_answer_tells() -> None:
    # GIVEN a pipeline that declares ``labels`` public and shares the step reading it
    pipeline = build_pipeline(public_config(PUBLIC, ["labels"]), CONFIGS, SERVED)
    assert [s.cache_shared for s in pipeline.steps] == [True, False, False]
    cache, stats, steps = MemoryCache(1 << 20), PipelineStats(), Steps()
    request = {**x([1, 2]), "labels": np.array([[3, 4]], dtype=np.float32)}
    # WHEN tenant A, then tenant B send the same labels
    first = drive(run_steps(pipeline, [request], cache, stats, scope=A), steps)[0]
    second = drive(run_steps(pipeline, [request], cache, stats, scope=B), steps)[0]
    # THEN B's step came from the one shared entry, and neither answer says so
    assert steps.computed.count(("double", 1)) == 1
    assert stats.step(0).cache_hits == 1
    assert first.cached == second.cached == []
    np.testing.assert_array_equal(first.tensors["out"], second.tensors["out"])


@pytest.mark.parametrize(
    ("steps", "public", "reason"),
    [
        # the shared step reads what a tenant sent
        (
            [
                step("double", {"a": "x"}, {"b": "out"}, cache=True, cache_scope="shared"),
                step("plus-one", {"a": "labels"}, {"b": "ignored"}),
            ],
            ["labels"],
            "cache_scope \"shared\" needs public inputs, but it reads 'x'",
        ),
        # nothing is declared public
        (PUBLIC, [], "needs public inputs, but it reads 'labels'"),
        # public by declaration, but made from a tenant's input on the way
        (
            [
                step("double", {"a": "x"}, {"b": "mixed"}),
                step("plus-one", {"a": "mixed"}, {"b": "out"}, cache=True, cache_scope="shared"),
                step("plus-one", {"a": "labels"}, {"b": "ignored"}),
            ],
            ["labels"],
            "reads 'mixed'",
        ),
        # a public input the pipeline does not have
        (PUBLIC, ["labels", "nope"], "public input 'nope' is not an input of the pipeline"),
    ],
)
def test_a_shared_cache_on_private_inputs_is_refused_at_load(
    steps: list[dict[str, Any]], public: list[str], reason: str
) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(reason)):
        build_pipeline(public_config(steps, public), CONFIGS, SERVED)


def test_a_shared_scope_without_a_cache_is_refused_by_the_schema() -> None:
    shared = step("double", {"a": "x"}, {"b": "out"}, cache_scope="shared")
    with pytest.raises(ValidationError, match="needs cache: true"):
        pipeline_config([shared])


def test_statistics_take_triton_shape_with_steps() -> None:
    pipeline = build_pipeline(pipeline_config(CHAIN), CONFIGS, SERVED)
    stats = PipelineStats()
    with stats.request(rows=2):
        drive(run_steps(pipeline, [x([1, 2], [3, 4])], None, stats, scope=A), Steps())
    with pytest.raises(InvalidInputError), stats.request(rows=1):
        raise InvalidInputError("bad")
    entry = stats.to_triton(pipeline, "1")
    assert (entry["name"], entry["inference_count"], entry["execution_count"]) == ("pipe", 2, 1)
    assert entry["inference_stats"]["fail"]["count"] == 1
    assert [s["step"] for s in entry["spillway"]["steps"]] == ["0:double", "1:plus-one"]
    assert [s["runs"] for s in entry["spillway"]["steps"]] == [1, 1]
