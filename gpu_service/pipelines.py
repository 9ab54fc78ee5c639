"""Pipelines in the GPU service: each step runs through its step model's own batcher.

A pipeline is a registry entry whose configuration is a pipeline, served behind the
same interface as a model (``gpu_service.served.Served``: ``PipelineEntry``). ``sync``
checks it against the repository (``spillway.pipelines.graph.read_pipeline``) and records
each of its versions as READY, or UNAVAILABLE with the reason, in the entry's states, so
a bad pipeline shows why in the repository index. A request runs the core step runner
(``spillway.pipelines.runner``); each step leases a version of its model from the registry
(loading it if it was scaled to zero), prepares the inputs the way that model's own
requests are prepared (tokenising off the event loop, announced to the batcher), and
awaits a place in that version's batcher. Concurrent pipeline requests therefore batch
per step, and pipelines sharing a model batch with each other and with the model's
direct requests (a mapped step's chunks of rows are each such a request, so rows of
concurrent requests batch too). The step model's own statistics count what the
pipeline sent it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpu_service.served import InferCall, InferResult, ModelEntry, Versions
from gpu_service.stats import RequestTimer
from gpu_service.versions import ServedVersion, State
from spillway import inference, tracing
from spillway.models.config import ModelConfig
from spillway.models.loader import chosen_versions
from spillway.models.processing import Tensors
from spillway.pipelines.graph import read_pipeline
from spillway.pipelines.runner import Compute, Effect, Resolve
from spillway.pipelines.serving import ServedPipeline, serve_async
from spillway.pipelines.stepcache import CacheSettings, StepCache, open_cache
from spillway.protocol.errors import (
    DeadlineExceededError,
    ModelNotFoundError,
    ModelNotReadyError,
    SpillwayError,
)


class _BatcherSteps:
    """Answers the step runner's effects for one request with the registry's versions.
    Its CPU steps (preparing a step's inputs) take the device's compute budget in the
    request's turn: every step of a page ranks by the page's arrival and deadline.
    The request's ``deadline`` (a ``time.perf_counter()`` instant) bounds every step: a
    step, or a chunk of rows, still queued when it passes leaves its batcher uncomputed
    (504), and none starts after it. Its chunks queue under its tenant's ``scope``, so
    the batchers share the device fairly between tenants."""

    def __init__(
        self,
        registry: Versions,
        *,
        priority: int,
        arrived: float,
        deadline: float,
        offload: inference.Offload,
        scope: str | None,
    ) -> None:
        self.registry = registry
        self.priority = priority
        self.arrived = arrived
        self.deadline = deadline
        self.offload = offload
        self.scope = scope
        self.leases: dict[int, ServedVersion] = {}

    def remaining(self) -> float:
        """Seconds left of the request's timeout (504 once it has passed)."""
        left = self.deadline - time.perf_counter()
        if left <= 0:
            raise DeadlineExceededError("the request's timeout passed before a step ran")
        return left

    async def __call__(self, effect: Effect) -> Any:
        if isinstance(effect, Resolve):
            return await self._resolve(effect)
        if isinstance(effect, Compute):
            served = self.leases[effect.step.index]
            label = effect.step.label
            return await asyncio.gather(*(self._compute(served, x, label) for x in effect.inputs))
        return await self.offload(effect.call) if effect.blocking else effect.call()

    async def _resolve(self, effect: Resolve) -> int:
        step = effect.step
        pinned = None if step.version is None else str(step.version)
        try:
            served, _ = await self.registry.acquire(step.model, pinned, self.remaining())
        except ModelNotFoundError as error:  # the step model went away: the pipeline's fault
            raise ModelNotReadyError(f"step {step.label}: {error.message}") from error
        self.leases[step.index] = served
        return served.model.version

    async def _compute(self, served: ServedVersion, inputs: Tensors, label: str) -> Tensors:
        """One request to a step model, counted in that model's statistics as a request
        of its own (Triton's composing-model statistics): every counter at once when it
        is answered, so perf_analyzer's check holds for composing models too. It is one
        ``spillway.pipeline.step`` span of the request's trace (its queue and batch
        within it)."""
        model = served.model
        attributes = {"spillway.step": label, "spillway.model": model.name}
        with tracing.span("spillway.pipeline.step", attributes=attributes) as span:
            span.set("spillway.version", model.version)
            return await self._computed(served, inputs)

    async def _computed(self, served: ServedVersion, inputs: Tensors) -> Tensors:
        batcher, model = served.batcher, served.model
        timer = RequestTimer(time.perf_counter())
        try:
            if model.batched_prepare:  # tokenising: off the loop, and announced
                steps = batcher.seat.offload_steps(self.offload, self.arrived, self.remaining())
                with batcher.incoming():
                    prepared = await steps(model.prepare, inputs)
            else:
                prepared = model.prepare(inputs)
            # The request's priority, within the levels this step model has.
            priority = min(self.priority, batcher.policy.priority_levels)
            outputs = await served.compute(
                prepared, priority, self.remaining(), timer, scope=self.scope
            )
        except SpillwayError:
            served.stats.record_failure(time.perf_counter() - timer.arrived)
            raise
        served.stats.record_success(timer)
        return outputs

    def release(self) -> None:
        for served in self.leases.values():
            served.release()


class Pipelines:
    """The registry's pipelines: checked definitions, statistics and the step cache."""

    def __init__(self, registry: Versions, cache: StepCache | None = None) -> None:
        self.registry = registry
        self.cache = cache
        self._served: dict[str, ServedPipeline] = {}

    @classmethod
    def from_env(cls, registry: Versions) -> Pipelines:
        """With the step cache ``PIPELINE_CACHE_*`` describes."""
        return cls(registry, open_cache(CacheSettings.from_env()))

    def entry(self, entry: ModelEntry) -> PipelineEntry:
        """The pipeline ``entry`` names, behind the interface a model has."""
        return PipelineEntry(self, entry)

    def ready(self, name: str, version: str | None = None) -> bool:
        """Checked, serving ``version`` (if named), and every step model can serve (ready,
        or loadable on first use)."""
        served = self._served.get(name)
        if served is None or (version is not None and version not in map(str, served.versions)):
            return False
        entries = [self.registry.models.get(m) for m in served.pipeline.models]
        return all(e is not None and e.last_error is None for e in entries)

    async def sync(
        self, entry: ModelEntry, config: ModelConfig, available: list[int]
    ) -> list[SpillwayError]:
        """Check the pipeline ``config`` describes (the entry's) and record each version's
        state; the failures."""
        wanted = chosen_versions(config.version_policy, available)
        try:
            if not wanted:
                raise ModelNotFoundError(f"pipeline {entry.name!r} has no version to serve")
            checked = await asyncio.to_thread(read_pipeline, self.registry.repository, config)
        except SpillwayError as error:
            self._served.pop(entry.name, None)
            entry.load_failures += 1
            entry.last_error = error.message
            for number in wanted:  # with none, the index shows the reason on the model
                entry.set_state(number, State.UNAVAILABLE, error.message)
            return [error]
        for number in set(entry.states) - set(wanted):
            entry.set_state(number, State.UNAVAILABLE, "unloaded: not served by the policy")
        old = self._served.get(entry.name)
        if old is not None and old.pipeline.steps == checked.steps:
            old.pipeline, old.versions = checked, wanted  # a re-check: keep its statistics
        else:
            self._served[entry.name] = ServedPipeline(checked, wanted)
            entry.loads += 1
        for number in wanted:
            entry.set_state(number, State.READY)
        entry.last_error = None
        return []

    def unload(self, entry: ModelEntry, reason: str) -> None:
        """Stop serving the pipeline (a later request checks it again, as a model
        scaled to zero loads again)."""
        if self._served.pop(entry.name, None) is not None:
            for number in list(entry.states):
                entry.set_state(number, State.UNAVAILABLE, f"unloaded: {reason}")

    async def checked(self, name: str) -> ServedPipeline:
        """The checked pipeline (checked now if it was never synced: a lazy start)."""
        served = self._served.get(name)
        if served is None:
            failures = await self.registry.sync(name)
            if failures:
                raise ModelNotReadyError(f"pipeline {name!r}: {failures[0].message}")
            served = self._served[name]
        return served

    def served(self, entry: ModelEntry, version: str | None = None) -> ServedPipeline:
        """A checked pipeline serving ``version`` (if named); 503 with the reason when
        it did not check out, 404 for a version it does not serve."""
        served = self._served.get(entry.name)
        if served is None:
            reason = entry.last_error or "not loaded"
            raise ModelNotReadyError(f"pipeline {entry.name!r}: {reason}")
        served.version(version)
        return served

    def stats(self) -> list[dict[str, Any]]:
        """Triton-shaped ``model_stats`` entries of every checked pipeline, by name."""
        return [_stats(served, None) for _, served in sorted(self._served.items())]

    def metric_lines(self) -> list[str]:
        """Prometheus lines per pipeline and per step."""
        lines: list[str] = []
        for name, help_text, read in _PIPELINE_METRICS:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            lines += [
                f'{name}{{pipeline="{n}"}} {read(s)}' for n, s in sorted(self._served.items())
            ]
        for name, help_text, field in _STEP_METRICS:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            for pipeline_name, served in sorted(self._served.items()):
                for step in served.pipeline.steps:
                    value = getattr(served.stats.step(step.index), field)
                    if field == "compute_ns":
                        value //= 1000
                    labels = f'pipeline="{pipeline_name}",step="{step.index}",model="{step.model}"'
                    lines.append(f"{name}{{{labels}}} {value}")
        return lines


@dataclass(frozen=True, slots=True)
class PipelineEntry:
    """A pipeline of the registry behind ``gpu_service.served.Served``: a request runs
    its steps, each on a version of its step model."""

    pipelines: Pipelines
    entry: ModelEntry

    def ready(self, version: str | None) -> bool:
        return self.pipelines.ready(self.entry.name, version)

    def metadata(self, version: str | None) -> dict[str, Any]:
        return self.pipelines.served(self.entry, version).metadata()

    def config(self, version: str | None) -> dict[str, Any]:
        if version is None and self.entry.config is not None:
            return self.entry.config.to_json_dict()
        return self.pipelines.served(self.entry, version).config.to_json_dict()

    def stats(self, version: str | None) -> list[dict[str, Any]]:
        return [_stats(self.pipelines.served(self.entry), version)]

    async def infer(self, version: str | None, call: InferCall) -> InferResult:
        """Run one request of tenant ``call.scope`` (its step cache entries are that
        tenant's) through the steps; the load signals are its busiest step version's."""
        pipelines = self.pipelines
        served = await pipelines.checked(self.entry.name)
        number = served.version(version)
        decoded = call.decoded
        timeout_s = served.pipeline.deadline_after(decoded.parameters.timeout_s)
        steps = _BatcherSteps(
            pipelines.registry,
            priority=decoded.parameters.priority or 0,
            arrived=call.arrived,
            deadline=call.arrived + timeout_s,
            offload=call.offload,
            scope=call.scope,
        )
        try:
            encoded = await serve_async(
                served, number, decoded, steps, pipelines.cache, scope=call.scope
            )
        finally:
            steps.release()
        batchers = [s.batcher for s in steps.leases.values()]
        return InferResult.of(
            encoded,
            max((b.queue_depth for b in batchers), default=0),
            max((b.busy_fraction() for b in batchers), default=0.0),
        )


def _stats(served: ServedPipeline, version: str | None) -> dict[str, Any]:
    number = str(served.version(version))
    return _per_request(served.stats.to_triton(served.pipeline, number))


def _per_request(entry: dict[str, Any]) -> dict[str, Any]:
    """A pipeline's entry with Triton's per-request counters, as Triton's ensembles have them:
    its requests queue and compute in their steps (each step model's entry has those
    times), so each successful request counts once here with no time of its own.
    perf_analyzer needs them: it finds the version it measures by its queue count
    growing, and reads every counter of every entry."""
    counters = entry["inference_stats"]
    requests = counters["success"]["count"]
    for kind in ("queue", "compute_input", "compute_infer", "compute_output"):
        counters.setdefault(kind, {"count": requests, "ns": 0})
    for kind in ("cache_hit", "cache_miss"):
        counters.setdefault(kind, {"count": 0, "ns": 0})
    return entry


_PIPELINE_METRICS: tuple[tuple[str, str, Callable[[ServedPipeline], int]], ...] = (
    (
        "spillway_pipeline_request_success_total",
        "Successful pipeline requests",
        lambda s: s.stats.success,
    ),
    (
        "spillway_pipeline_request_failure_total",
        "Failed pipeline requests",
        lambda s: s.stats.failure,
    ),
    (
        "spillway_pipeline_request_duration_us",
        "Cumulative end-to-end time of successful pipeline requests",
        lambda s: s.stats.success_ns // 1000,
    ),
)
_STEP_METRICS = (
    ("spillway_pipeline_step_runs_total", "Requests a step ran for (computed or cached)", "runs"),
    ("spillway_pipeline_step_skipped_total", "Requests a step was skipped for", "skipped"),
    ("spillway_pipeline_cache_hits_total", "Step results taken from the cache", "cache_hits"),
    (
        "spillway_pipeline_cache_misses_total",
        "Step results computed after a cache miss",
        "cache_misses",
    ),
    (
        "spillway_pipeline_step_duration_us",
        "Cumulative time requests spent in a step",
        "compute_ns",
    ),
)
