"""Serving pipelines with the step runner (``spillway.pipelines.runner``): what every
deployable shares around it.

* ``Described``: what every server answers about a name it serves, a model or an
  pipeline alike (the GPU service's ``gpu_service.served.Served`` and the CPU fallback's
  ``spillway.fallback.service.CpuServed`` build on it).
* ``ServedPipeline``: a checked pipeline, the versions it answers to, its statistics.
* ``admit`` / ``encode``: the request path's own steps (``spillway.inference``) with an
  pipeline as the signature; the response also names the skipped and cached steps.
  ``serve`` and ``serve_async`` run one request between them (the CPU fallback, the GPU
  service).
* ``PipelineJobModel``: a pipeline version as a batch job's model, each step run once
  per batch of records.
* ``PipelineSet``: the pipelines one process serves over its loaded models, and those it
  refused at load, with why.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from spillway import inference
from spillway.inference import Admitted, Decoded, Encoded
from spillway.models.config import ModelConfig
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.loader import chosen_versions, load_version, served_versions
from spillway.models.processing import Prepared, Tensors
from spillway.models.repository import ModelRepository
from spillway.pipelines.definition import Pipeline, check_inputs, pipeline_metadata
from spillway.pipelines.graph import read_pipeline
from spillway.pipelines.runner import (
    Effect,
    LocalSteps,
    Outcome,
    PipelineStats,
    Resolver,
    drive,
    drive_async,
    run_steps,
)
from spillway.pipelines.stepcache import StepCache
from spillway.protocol.errors import (
    ModelLoadError,
    ModelNotFoundError,
    ModelNotReadyError,
    SpillwayError,
)
from spillway.protocol.names import validate_version

log = logging.getLogger("spillway.pipeline")


# --- serving ----------------------------------------------------------------------------


class Described(Protocol):
    """A name a server serves, whatever its kind, as the Open Inference Protocol's
    per-model documents describe it. ``version`` is the one a request names, or ``None``
    for the one that serves now (404 for a version not served)."""

    def metadata(self, version: str | None) -> dict[str, Any]:
        """``GET /v2/models/{name}[/versions/{v}]``."""
        ...

    def config(self, version: str | None) -> dict[str, Any]:
        """``GET /v2/models/{name}[/versions/{v}]/config``."""
        ...


@dataclass
class ServedPipeline:
    """A pipeline as a server holds it: the versions it answers to and its statistics;
    the signature requests are admitted against (``spillway.inference.Signature``)."""

    pipeline: Pipeline
    versions: list[int]
    stats: PipelineStats = field(default_factory=PipelineStats)

    @property
    def name(self) -> str:
        return self.pipeline.name

    @property
    def config(self) -> ModelConfig:
        return self.pipeline.config

    @property
    def output_names(self) -> list[str]:
        return self.pipeline.output_names

    def prepare(self, inputs: Tensors) -> Prepared:
        """Check the inputs against the pipeline's; each step prepares its own."""
        return Prepared(inputs, check_inputs(self.config, inputs))

    def version(self, requested: str | None) -> int:
        """The version a request gets: the one it names, else the default one."""
        if requested is None:
            return self.config.default_version(self.versions) or max(self.versions)
        number = validate_version(requested)
        if number not in self.versions:
            raise ModelNotFoundError(f"pipeline {self.name!r} has no version {number} served")
        return number

    def metadata(self) -> dict[str, Any]:
        """``GET /v2/models/{pipeline}``."""
        return pipeline_metadata(self.pipeline, self.versions)


def admit(served: ServedPipeline, decoded: Decoded) -> Admitted:
    """Check a decoded request against the pipeline's signature, parameters and outputs
    (``spillway.inference.admit``: the same checks, in the same order, as a model's)."""
    return inference.admit(served, decoded)


def encode(served: ServedPipeline, version: int, admitted: Admitted, outcome: Outcome) -> Encoded:
    """The response, as ``spillway.inference.encode`` makes a model's but for two things
    a pipeline has and a model has not: a step its condition skipped made no outputs,
    so only the outputs asked for that were made are sent (a model makes every output);
    and the steps skipped or answered from the step cache are named in ``parameters``
    (``skipped_steps``, ``cached_steps``)."""
    parameters: dict[str, Any] = {}
    if outcome.skipped:
        parameters["skipped_steps"] = ",".join(outcome.skipped)
    if outcome.cached:
        parameters["cached_steps"] = ",".join(outcome.cached)
    outputs = {n: outcome.tensors[n] for n in admitted.outputs if n in outcome.tensors}
    return inference.encode_outputs(served.name, version, admitted, outputs, parameters or None)


def serve(
    served: ServedPipeline,
    version: int,
    decoded: Decoded,
    handle: Callable[[Effect], Any],
    cache: StepCache | None,
    *,
    scope: str | None,
) -> Encoded:
    """One request of tenant ``scope`` through the pipeline on this thread (the CPU
    fallback)."""
    admitted = admit(served, decoded)
    with served.stats.request(admitted.prepared.rows):
        run = run_steps(served.pipeline, [decoded.arrays], cache, served.stats, scope=scope)
        outcome = drive(run, handle)[0]
    return encode(served, version, admitted, outcome)


async def serve_async(
    served: ServedPipeline,
    version: int,
    decoded: Decoded,
    handle: Callable[[Effect], Awaitable[Any]],
    cache: StepCache | None,
    *,
    scope: str | None,
) -> Encoded:
    """One request of tenant ``scope`` through the pipeline, each effect awaited (the GPU
    service)."""
    admitted = admit(served, decoded)
    with served.stats.request(admitted.prepared.rows):
        run = run_steps(served.pipeline, [decoded.arrays], cache, served.stats, scope=scope)
        outcome = (await drive_async(run, handle))[0]
    return encode(served, version, admitted, outcome)


# --- offline: the batch job -------------------------------------------------------------


class PipelineJobModel:
    """A pipeline version as an offline job's model (``batch_job.shard.JobModel``): a
    batch of records runs each step once over all of them (one tokenising call, one
    engine run), and each record gets the pipeline outputs it made. Every record is the
    job's tenant's (``scope``): the cache entries it reads and writes are that tenant's."""

    def __init__(
        self,
        served: ServedPipeline,
        version: int,
        resolve: Resolver,
        cache: StepCache | None = None,
        *,
        scope: str,
    ) -> None:
        self.served = served
        self.scope = scope
        self.name = served.name
        self.version = version
        self.config = served.config
        self._resolve = resolve
        self._cache = cache

    @property
    def batching(self) -> bool:
        return self.config.max_batch_size > 0

    def prepare(self, inputs: Tensors) -> Prepared:
        """Check one record against the pipeline's inputs (the steps prepare their own)."""
        return self.served.prepare(inputs)

    def prepare_many(self, requests: Sequence[Tensors]) -> list[Prepared | SpillwayError]:
        """``prepare`` for each record; a record's error is its own."""
        out: list[Prepared | SpillwayError] = []
        for inputs in requests:
            try:
                out.append(self.prepare(inputs))
            except SpillwayError as error:
                out.append(error)
        return out

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        """Every step over the batch's records; one output dict per record, in order."""
        feeds = [p.feeds for p in batch]
        run = run_steps(
            self.served.pipeline, feeds, self._cache, self.served.stats, scope=self.scope
        )
        return [outcome.tensors for outcome in drive(run, LocalSteps(self._resolve))]


def load_pipeline_version(
    repository: ModelRepository,
    config: ModelConfig,
    version: int,
    cache_dir: Path,
    options: EngineOptions,
    cache: StepCache | None = None,
    *,
    scope: str,
) -> PipelineJobModel:
    """A pipeline version for a batch job of tenant ``scope``: checked, with the step
    models' versions it runs loaded (pinned ones, else the version each step model
    serves); blocking."""
    pipeline = read_pipeline(repository, config)
    models: dict[tuple[str, str | None], OnnxModel] = {}
    for step in pipeline.steps:
        pinned = None if step.version is None else str(step.version)
        if (step.model, pinned) not in models:
            step_config = repository.read_config(step.model)
            versions = chosen_versions(
                step_config.version_policy, repository.list_versions(step.model)
            )
            number = step.version or step_config.default_version(versions)
            if number is None:
                raise ModelNotFoundError(f"model {step.model!r} has no version to serve")
            models[step.model, pinned] = load_version(
                repository, step_config, number, cache_dir, options
            )
    served = ServedPipeline(pipeline, [version])
    return PipelineJobModel(served, version, lambda name, v: models[name, v], cache, scope=scope)


# --- a process's pipelines --------------------------------------------------------------


@dataclass
class PipelineSet:
    """The pipelines a process serves over its loaded models (the CPU fallback), those
    refused at load and why (one bad pipeline never stops the others from serving), and
    the step cache they share."""

    served: dict[str, ServedPipeline] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    cache: StepCache | None = None

    @classmethod
    def read(
        cls, repository: ModelRepository, names: list[str] | None, cache: StepCache | None
    ) -> PipelineSet:
        """The pipelines among ``names`` (all when ``None``), checked; blocking."""
        found = cls(cache=cache)
        for name in repository.list_models() if names is None else names:
            config = repository.read_config(name)
            if config.is_pipeline:
                found.add(repository, config)
        return found

    def add(self, repository: ModelRepository, config: ModelConfig) -> None:
        """Check and serve the pipeline ``config`` describes (refused, with the reason,
        when it cannot be); blocking."""
        name = config.name
        try:
            versions = served_versions(repository, name)[1]
            self.served[name] = ServedPipeline(read_pipeline(repository, config), versions)
        except (ModelLoadError, ModelNotFoundError) as error:
            log.error("pipeline %s refused: %s", name, error.message)
            self.refused[name] = error.message

    def models(self, names: list[str] | None) -> list[str] | None:
        """The models to load for ``names`` (``None``: all): those named and every step
        model of the pipelines served."""
        if names is None:
            return None
        steps = {m for served in self.served.values() for m in served.pipeline.models}
        return sorted(({*names} | steps) - self.served.keys() - self.refused.keys())

    def find(self, name: str, version: str | None) -> ServedPipeline | None:
        """The pipeline ``name`` serving ``version`` (if named); ``None`` when ``name`` is
        not a pipeline; 503 with the reason for one refused at load."""
        reason = self.refused.get(name)
        if reason is not None:
            raise ModelNotReadyError(f"pipeline {name!r} was refused at load: {reason}")
        served = self.served.get(name)
        if served is not None:
            served.version(version)
        return served

    def serve(
        self,
        served: ServedPipeline,
        version: str | None,
        decoded: Decoded,
        resolve: Resolver,
        arrived: float,
        *,
        scope: str | None,
    ) -> Encoded:
        """One request of tenant ``scope`` on this thread; ``arrived`` is its
        ``time.monotonic()`` arrival. Its work stops at its deadline (its timeout, at most
        the pipeline's ``timeout_s``)."""
        timeout = served.pipeline.deadline_after(decoded.parameters.timeout_s)
        steps = LocalSteps(resolve, arrived + timeout)
        return serve(served, served.version(version), decoded, steps, self.cache, scope=scope)
