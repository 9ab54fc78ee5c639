"""Pipelines (Triton's ensembles): several models in one request, each step run by its
own model. This module builds one from its configuration, with its checks and its run
order; ``spillway.pipelines.definition`` holds what it builds, ``spillway.pipelines.runner``
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
from collections.abc import Mapping, Sequence

from spillway.models.config import ModelConfig
from spillway.models.loader import chosen_versions
from spillway.models.pipeline_schema import PipelineStep, StepCondition, StepMap
from spillway.models.repository import ModelRepository
from spillway.pipelines.definition import Pipeline, Spec, Step, dims_fit, tensor_specs
from spillway.pipelines.fanout import COUNT_TYPES, FanOut
from spillway.protocol.errors import ModelLoadError, ModelNotFoundError

_NUMERIC = frozenset(
    {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
    | {"FP16", "FP32", "FP64"}
)


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
        self.tensors: dict[str, Spec] = tensor_specs(config.input)
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
        made = tensor_specs(model.output)
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
        wanted = tensor_specs(model.input)
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
        wanted = tensor_specs(model.input)
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
            if not dims_fit(have[1][1:], take):
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
        made = tensor_specs(model.output)
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
        if not dims_fit(have[1], want[1]):
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
