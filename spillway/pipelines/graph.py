"""Pipelines (Triton's ensembles): several models in one request, each step run by its
own model. This module holds the definition and its checks; ``spillway.pipelines.runner``
runs it.

A pipeline is a model of the repository whose ``config.json`` has ``platform:
"ensemble"`` and an ``ensemble_scheduling`` block (``spillway.models.pipeline_schema``);
its version folders hold no model. Its ``input``/``output`` are what clients send and get.

Loading (``read_pipeline``, ``build_pipeline``) checks the steps against the step
models' configurations and refuses, with the reason, a pipeline that names an unknown
model or an unserved version, maps a tensor nothing makes, joins tensors of different
datatypes or shapes, leaves a step input unfed or a pipeline input unread, or whose
steps read each other's outputs in a cycle, or a mapped step (``spillway.map``) whose
rows or counts it cannot use (``spillway.pipelines.fanout``). Steps run in an order
where each comes after the steps it reads from (the configuration's order breaks ties).
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spillway.models.config import ModelConfig, TensorConfig
from spillway.models.engine import config_metadata
from spillway.models.loader import chosen_versions
from spillway.models.pipeline_schema import DEFAULT_TIMEOUT_S, PipelineStep, StepCondition, StepMap
from spillway.models.processing import Tensors
from spillway.models.repository import ModelRepository
from spillway.pipelines.fanout import COUNT_TYPES, FanOut
from spillway.protocol.datatypes import datatype_of
from spillway.protocol.errors import (
    BatchTooLargeError,
    InvalidInputError,
    ModelLoadError,
    ModelNotFoundError,
)

_OPS: dict[str, Callable[[Any, float], Any]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}
_NUMERIC = frozenset(
    {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
    | {"FP16", "FP32", "FP64"}
)


# --- the definition -----------------------------------------------------------------------


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


def _fits(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


def _specs(tensors: tuple[TensorConfig, ...]) -> dict[str, Spec]:
    return {t.name: (t.datatype, t.dims) for t in tensors}


def _digest(config: ModelConfig) -> str:
    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()


class _Checker:
    """Builds a pipeline from its configuration and its step models' configurations,
    raising ``ModelLoadError`` with the first reason it cannot serve."""

    def __init__(
        self,
        config: ModelConfig,
        configs: Mapping[str, ModelConfig],
        served: Mapping[str, Sequence[int]],
    ) -> None:
        self.config = config
        self.configs = configs
        self.served = served
        self.where = f"pipeline {config.name!r}"
        self.tensors: dict[str, Spec] = _specs(config.input)
        self.producers: dict[str, int] = {}

    def fail(self, reason: str) -> ModelLoadError:
        return ModelLoadError(f"{self.where}: {reason}")

    def build(self) -> Pipeline:
        if self.config.spillway.kind != "tensor":
            raise self.fail('a pipeline has kind "tensor" (its steps do any preparing)')
        scheduling = self.config.ensemble_scheduling
        if scheduling is None:
            raise self.fail('platform "ensemble" needs ensemble_scheduling')
        models = [self._model(i, s) for i, s in enumerate(scheduling.step)]
        self._all_outputs(list(enumerate(zip(scheduling.step, models, strict=True))))
        steps = [
            self._step(i, s, m)
            for i, (s, m) in enumerate(zip(scheduling.step, models, strict=True))
        ]
        self._check_outputs()
        ordered = self._ordered(steps)
        self._check_shared(ordered)
        read = set().union(*(s.reads for s in steps))
        unread = [t.name for t in self.config.input if t.name not in read]
        if unread:
            raise self.fail(f"input {unread[0]!r} is read by no step")
        return Pipeline(self.config, tuple(ordered))

    def _model(self, index: int, spec: PipelineStep) -> ModelConfig:
        label = f"step {index} ({spec.model_name})"
        model = self.configs.get(spec.model_name)
        if model is None:
            raise self.fail(f"{label}: unknown model {spec.model_name!r}")
        if model.is_pipeline:
            raise self.fail(f"{label}: {spec.model_name!r} is a pipeline; list its steps here")
        served = self.served.get(spec.model_name, ())
        if spec.model_version != -1 and spec.model_version not in served:
            raise self.fail(
                f"{label}: version {spec.model_version} of {spec.model_name!r} is not served "
                f"(served: {list(served)})"
            )
        if spec.spillway.map is not None:
            return model  # it gets rows, not the pipeline's requests: any batch size fits
        batching, own = self.config.max_batch_size > 0, model.max_batch_size > 0
        if batching != own:
            raise self.fail(
                f"{label}: the pipeline {'batches' if batching else 'does not batch'} and "
                f"{spec.model_name!r} {'does' if own else 'does not'} (max_batch_size)"
            )
        if model.max_batch_size < self.config.max_batch_size:
            raise self.fail(
                f"{label}: max_batch_size {self.config.max_batch_size} exceeds "
                f"{spec.model_name!r}'s {model.max_batch_size}"
            )
        return model

    def _all_outputs(self, pending: list[tuple[int, tuple[PipelineStep, ModelConfig]]]) -> None:
        """Every step's outputs as pipeline tensors; a mapped step's once the tensors it
        maps over are known (its rows' shape says how its model takes them)."""
        while pending:
            known = self.tensors.keys()
            ready = [
                p
                for p in pending
                if p[1][0].spillway.map is None or set(p[1][0].input_map.values()) <= known
            ]
            for index, (spec, model) in ready or pending[:1]:  # none: a cycle, told later
                self._outputs(index, spec, model)
                pending.remove((index, (spec, model)))

    def _outputs(self, index: int, spec: PipelineStep, model: ModelConfig) -> None:
        made = _specs(model.output)
        if spec.spillway.map is not None:  # gathered per item: rows of what it makes
            made = {n: (t, (-1, *d)) for n, (t, d) in self._row_outputs(index, spec, model).items()}
        for model_output, tensor in spec.output_map.items():
            if model_output not in made:
                raise self.fail(
                    f"step {index} ({spec.model_name}): {spec.model_name!r} has no output "
                    f"{model_output!r} (it has {sorted(made)})"
                )
            if tensor in self.tensors:
                raise self.fail(f"step {index} ({spec.model_name}) overwrites input {tensor!r}")
            self.tensors[tensor] = made[model_output]
            self.producers[tensor] = index

    def _step(self, index: int, spec: PipelineStep, model: ModelConfig) -> Step:
        label = f"step {index} ({spec.model_name})"
        wanted = _specs(model.input)
        unfed = sorted(wanted.keys() - spec.input_map.keys())
        if unfed:
            raise self.fail(f"{label}: input {unfed[0]!r} of {spec.model_name!r} is not mapped")
        mapped = spec.spillway.map
        fanout = None if mapped is None else self._fanout(index, spec, model, mapped)
        for model_input, tensor in spec.input_map.items():
            if model_input not in wanted:
                raise self.fail(f"{label}: {spec.model_name!r} has no input {model_input!r}")
            if fanout is None:
                self._joins(label, tensor, f"{spec.model_name}.{model_input}", wanted[model_input])
        condition = spec.spillway.condition
        if condition is not None:
            self._check_condition(label, condition)
        return Step(
            index=index,
            model=spec.model_name,
            version=None if spec.model_version == -1 else spec.model_version,
            input_map=dict(spec.input_map),
            output_map=dict(spec.output_map),
            condition=condition,
            cache=spec.spillway.cache,
            cache_shared=spec.spillway.cache_scope == "shared",
            config_digest=_digest(model),
            batching=self.config.max_batch_size > 0,
            fanout=fanout,
        )

    def _fanout(
        self, index: int, spec: PipelineStep, model: ModelConfig, mapped: StepMap
    ) -> FanOut:
        """A mapped step's rows: its counts one INT32/INT64 per item, each tensor it maps
        over rows of what its model takes, in the pipeline's layout."""
        label = f"step {index} ({spec.model_name})"
        padded = self.config.max_batch_size > 0
        counts = self.tensors.get(mapped.counts)
        if counts is None:
            raise self.fail(
                f"{label}: map counts {mapped.counts!r} is neither an input nor made by a step"
            )
        if counts[0] not in COUNT_TYPES:
            raise self.fail(
                f"{label}: map counts {mapped.counts!r} is {counts[0]}, not INT32/INT64"
            )
        dims = counts[1] if padded else counts[1][1:]  # a non-batching one: [items, ...]
        if dims not in ((), (1,)) or (not padded and not counts[1]):
            raise self.fail(
                f"{label}: map counts {mapped.counts!r} has dims {list(counts[1])}; one count "
                f"per item is {'[] or [1]' if padded else '[-1] or [-1, 1]'}"
            )
        wanted = _specs(model.input)
        lead = self._lead(label, spec, model)
        for model_input, tensor in spec.input_map.items():
            have = self.tensors.get(tensor)
            if have is None:
                raise self.fail(
                    f"{label}: maps over {tensor!r}, neither an input nor made by a step"
                )
            if not have[1]:
                raise self.fail(
                    f"{label}: maps over {tensor!r}, which has no rows (dims []): it needs "
                    f"{'[slots, ...] per item' if padded else '[rows, ...]'}"
                )
            want = wanted.get(model_input)
            if want is None:
                continue  # reported with the step's other inputs
            take = want[1][1:] if lead and model.max_batch_size == 0 else want[1]
            reader = f"{spec.model_name}.{model_input}"
            if have[0] != want[0]:
                raise self.fail(f"{label}: {tensor!r} is {have[0]} but {reader} takes {want[0]}")
            if not _fits(have[1][1:], take):
                raise self.fail(
                    f"{label}: a row of {tensor!r} has dims {list(have[1][1:])} but {reader} "
                    f"takes {list(take)} per row"
                )
        inputs = (*spec.input_map.values(), mapped.counts)
        return FanOut(
            inputs=dict(spec.input_map),
            counts=mapped.counts,
            padded=padded,
            chunk=max(model.max_batch_size, 1),
            lead=lead,
            outputs=self._row_outputs(index, spec, model),
            caller=all(t not in self.producers for t in inputs),
            max_rows=mapped.max_rows,
            where=f"step {index}:{spec.model_name} of pipeline {self.config.name!r}",
        )

    def _lead(self, label: str, spec: PipelineStep, model: ModelConfig) -> bool:
        """Whether rows go to the model with a leading dimension of one: always when it
        batches; when it does not, if its inputs' first dimension is 1 (or -1) and one
        more than a row's."""
        if model.max_batch_size > 0:
            return True
        rows = {m: self.tensors.get(t) for m, t in spec.input_map.items()}
        return all(
            have is not None and len(t.dims) == len(have[1]) and t.dims[:1] in ((1,), (-1,))
            for t in model.input
            for have in [rows.get(t.name)]
        )

    def _row_outputs(self, index: int, spec: PipelineStep, model: ModelConfig) -> dict[str, Spec]:
        """A mapped step model's outputs per row: a leading dimension of one taken off
        when its rows go with one."""
        made = _specs(model.output)
        if model.max_batch_size > 0 or not self._lead(f"step {index}", spec, model):
            return made
        for name, (_, dims) in made.items():
            if dims[:1] not in ((1,), (-1,)):
                raise self.fail(
                    f"step {index} ({spec.model_name}): rows go to {spec.model_name!r} one by "
                    f"one with a leading dimension of 1, but its output {name!r} has dims "
                    f"{list(dims)}"
                )
        return {name: (datatype, dims[1:]) for name, (datatype, dims) in made.items()}

    def _joins(self, label: str, tensor: str, reader: str, want: Spec) -> None:
        have = self.tensors.get(tensor)
        if have is None:
            raise self.fail(f"{label}: tensor {tensor!r} is neither an input nor made by a step")
        if have[0] != want[0]:
            raise self.fail(f"{label}: {tensor!r} is {have[0]} but {reader} takes {want[0]}")
        if not _fits(have[1], want[1]):
            raise self.fail(
                f"{label}: {tensor!r} has dims {list(have[1])} but {reader} takes {list(want[1])}"
            )

    def _check_condition(self, label: str, condition: StepCondition) -> None:
        have = self.tensors.get(condition.tensor)
        if have is None:
            raise self.fail(f"{label}: the condition reads unknown tensor {condition.tensor!r}")
        if have[0] not in _NUMERIC:
            raise self.fail(f"{label}: the condition reads {have[0]} tensor {condition.tensor!r}")
        width = math.prod(have[1])
        if condition.element is not None and -1 not in have[1] and condition.element >= width:
            raise self.fail(
                f"{label}: the condition reads element {condition.element} of "
                f"{condition.tensor!r}, which has {width} per row"
            )

    def _check_outputs(self) -> None:
        for output in self.config.output:
            if output.name not in self.producers:
                raise self.fail(f"output {output.name!r} is made by no step")
            self._joins(
                "output", output.name, f"output {output.name}", (output.datatype, output.dims)
            )

    def _check_shared(self, ordered: list[Step]) -> None:
        """A step may share its cache across tenants only if everything it reads is
        public: a public input, or made by steps that read only public tensors."""
        scheduling = self.config.ensemble_scheduling
        declared = scheduling.spillway.public_inputs if scheduling else ()
        inputs = {t.name for t in self.config.input}
        for name in declared:
            if name not in inputs:
                raise self.fail(f"public input {name!r} is not an input of the pipeline")
        public = set(declared)
        for step in ordered:
            private = sorted(step.reads - public)
            if step.cache_shared and private:
                raise self.fail(
                    f'step {step.index} ({step.model}): cache_scope "shared" needs public '
                    f"inputs, but it reads {private[0]!r}, which holds what a tenant sent "
                    "(list only inputs every tenant may see in spillway.public_inputs)"
                )
            if not private:
                public |= set(step.output_map.values())

    def _ordered(self, steps: list[Step]) -> list[Step]:
        """Each step after the steps whose tensors it reads (Kahn's algorithm)."""
        needs = {
            s.index: {self.producers[t] for t in s.reads if t in self.producers} for s in steps
        }
        order: list[Step] = []
        waiting = list(steps)
        while waiting:
            done = {s.index for s in order}
            ready = [s for s in waiting if needs[s.index] <= done]
            if not ready:
                cycle = ", ".join(s.label for s in waiting)
                raise self.fail(f"steps {cycle} read each other's outputs in a cycle")
            order.append(ready[0])
            waiting.remove(ready[0])
        return order


def build_pipeline(
    config: ModelConfig,
    configs: Mapping[str, ModelConfig],
    served: Mapping[str, Sequence[int]],
) -> Pipeline:
    """The pipeline ``config`` describes, checked against its step models'
    configurations (``configs``) and served versions; ``ModelLoadError`` if it cannot run."""
    return _Checker(config, configs, served).build()


def read_pipeline(repository: ModelRepository, config: ModelConfig) -> Pipeline:
    """``build_pipeline`` with the step models read from ``repository``; blocking."""
    configs: dict[str, ModelConfig] = {}
    served: dict[str, list[int]] = {}
    steps = config.ensemble_scheduling.step if config.ensemble_scheduling else ()
    for name in sorted({s.model_name for s in steps}):
        try:
            configs[name] = repository.read_config(name)
            versions = repository.list_versions(name)
        except ModelNotFoundError:
            continue  # reported as an unknown model, with the step that names it
        except ModelLoadError as error:
            raise ModelLoadError(f"pipeline {config.name!r}: {error.message}") from error
        served[name] = chosen_versions(configs[name].version_policy, versions)
    return build_pipeline(config, configs, served)


def pipeline_metadata(pipeline: Pipeline, versions: list[int]) -> dict[str, Any]:
    """The Open Inference Protocol metadata of a pipeline, its steps in ``parameters``."""
    meta = config_metadata(pipeline.config, versions)
    meta["parameters"] = {"steps": ",".join(s.label for s in pipeline.steps)}
    return meta


def check_inputs(config: ModelConfig, inputs: Tensors) -> int:
    """Check a request's tensors against the pipeline's inputs (names, datatypes, shapes,
    batch size); its row count. The step models check their own limits again."""
    wanted = _specs(config.input)
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
        if not _fits(tuple(array.shape), shape) or (batching and array.shape[0] < 1):
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
