"""A pipeline as it runs: its steps in run order, what each reads and makes, whether its
condition holds, and the inputs a request must bring.

``spillway.pipelines.graph`` builds a ``Pipeline`` from a configuration, checking it
against its step models; ``spillway.pipelines.runner`` runs it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from spillway.models.config import ModelConfig, TensorConfig
from spillway.models.engine import config_metadata
from spillway.models.pipeline_schema import DEFAULT_TIMEOUT_S, StepCondition
from spillway.models.processing import Tensors
from spillway.pipelines.fanout import FanOut
from spillway.protocol.datatypes import datatype_of
from spillway.protocol.errors import BatchTooLargeError, InvalidInputError

_OPS: dict[str, Callable[[Any, float], Any]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}


@dataclass(frozen=True)
class Step:
    """One step as it runs: its model, the tensors it reads and makes, its options."""

    index: int
    """Its place in the configuration (steps are named ``<index>:<model>``)."""
    model: str
    version: int | None
    """The pinned version; ``None``: the one the model serves."""
    input_map: Mapping[str, str]
    output_map: Mapping[str, str]
    condition: StepCondition | None
    cache: bool
    cache_shared: bool
    """The cache is one for every tenant (the step reads only public inputs)."""
    config_digest: str
    """sha256 of the step model's configuration, part of every cache key."""
    batching: bool
    """The pipeline's tensors have a batch dimension (its ``max_batch_size`` > 0)."""
    fanout: FanOut | None = None
    """How the step runs over rows, when it maps (``spillway.map``)."""

    @property
    def label(self) -> str:
        """``<index>:<model>``, as responses, statistics and metrics name the step."""
        return f"{self.index}:{self.model}"

    @property
    def reads(self) -> frozenset[str]:
        """The pipeline tensors the step needs: its inputs and its condition's tensor."""
        extra = {self.condition.tensor} if self.condition else set()
        if self.fanout is not None:
            extra.add(self.fanout.counts)
        return frozenset(self.input_map.values()) | extra

    def runs_on(self, tensors: Tensors) -> bool:
        """Whether the step runs for a request holding ``tensors``: everything it reads
        was made, and its condition (if any) holds."""
        if not self.reads <= tensors.keys():
            return False
        return self.condition is None or condition_holds(
            self.condition, tensors[self.condition.tensor], self.batching
        )

    def inputs_of(self, tensors: Tensors) -> Tensors:
        """The step model's inputs, from the pipeline's tensors."""
        return {model_input: tensors[tensor] for model_input, tensor in self.input_map.items()}

    def outputs_of(self, result: Tensors) -> Tensors:
        """The pipeline tensors the step makes, from its model's outputs."""
        return {tensor: result[model_output] for model_output, tensor in self.output_map.items()}


@dataclass(frozen=True)
class Pipeline:
    """A validated pipeline: its configuration and its steps in run order."""

    config: ModelConfig
    steps: tuple[Step, ...]

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def output_names(self) -> list[str]:
        """The served outputs, in the configuration's order."""
        return [o.name for o in self.config.output]

    @property
    def models(self) -> set[str]:
        """The step models."""
        return {s.model for s in self.steps}

    @property
    def timeout_s(self) -> float:
        """The longest one request may run through it (``SchedulingOptions.timeout_s``)."""
        scheduling = self.config.ensemble_scheduling
        return scheduling.spillway.timeout_s if scheduling else DEFAULT_TIMEOUT_S

    def deadline_after(self, requested_s: float | None) -> float:
        """Seconds a request that asked for ``requested_s`` (``None``: nothing) may run:
        its own timeout may only lower the pipeline's."""
        limit = self.timeout_s
        return limit if requested_s is None else min(requested_s, limit)


def condition_holds(condition: StepCondition, array: np.ndarray, batching: bool) -> bool:
    """Whether ``rows`` of ``array`` (one number per row: its ``element`` or its
    ``reduce``) pass ``op value``."""
    values = np.asarray(array, dtype=np.float64)
    rows = values.reshape(values.shape[0] if batching else 1, -1)
    if condition.element is not None:
        if condition.element >= rows.shape[1]:
            raise InvalidInputError(
                f"the condition reads element {condition.element} of {condition.tensor!r}, "
                f"which has {rows.shape[1]} per row"
            )
        per_row = rows[:, condition.element]
    else:
        per_row = getattr(np, condition.reduce)(rows, axis=1)
    passed = _OPS[condition.op](per_row, condition.value)
    return bool(passed.any() if condition.rows == "any" else passed.all())


Spec = tuple[str, tuple[int, ...]]
"""A tensor's datatype and dims (without the batch dimension)."""


def dims_fit(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether dims ``a`` fit dims ``b`` (``-1``, on either side, fits any size)."""
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


def tensor_specs(tensors: tuple[TensorConfig, ...]) -> dict[str, Spec]:
    """Each tensor's ``Spec``, by name."""
    return {t.name: (t.datatype, t.dims) for t in tensors}


def pipeline_metadata(pipeline: Pipeline, versions: list[int]) -> dict[str, Any]:
    """The Open Inference Protocol metadata of a pipeline, its steps in ``parameters``."""
    meta = config_metadata(pipeline.config, versions)
    meta["parameters"] = {"steps": ",".join(s.label for s in pipeline.steps)}
    return meta


def check_inputs(config: ModelConfig, inputs: Tensors) -> int:
    """Check a request's tensors against the pipeline's inputs (names, datatypes, shapes,
    batch size); its row count. The step models check their own limits again."""
    wanted = tensor_specs(config.input)
    if inputs.keys() != wanted.keys():
        extra = sorted(inputs.keys() - wanted.keys())
        if extra:
            raise InvalidInputError(f"unknown input {extra[0]!r} for pipeline {config.name}")
        missing = sorted(wanted.keys() - inputs.keys())[0]
        raise InvalidInputError(f"missing input {missing!r} for pipeline {config.name}")
    batching = config.max_batch_size > 0
    rows = set()
    for name, array in inputs.items():
        datatype, dims = wanted[name]
        if datatype_of(array) != datatype:
            raise InvalidInputError(f"input {name!r} must be {datatype}, got {datatype_of(array)}")
        shape = (-1, *dims) if batching else dims
        if not dims_fit(tuple(array.shape), shape) or (batching and array.shape[0] < 1):
            raise InvalidInputError(
                f"input {name!r} must have shape {list(shape)}, got {list(array.shape)}"
            )
        rows.add(int(array.shape[0]) if batching else 1)
    if len(rows) != 1:
        raise InvalidInputError("all inputs must have the same batch size")
    count = rows.pop()
    if batching and count > config.max_batch_size:
        raise BatchTooLargeError(f"batch of {count} exceeds max_batch_size {config.max_batch_size}")
    return count
