"""Running a pipeline (``spillway.pipelines.graph``), written once for every deployable.

``run_steps`` does no I/O: it is a generator that yields what it needs and is sent the
answers —

* ``Resolve(step)``: which version of the step model runs (the driver holds that version
  until the run ends); answer: the version number.
* ``CacheIO(call)``: a cache call (``spillway.pipelines.stepcache``); answer: its result.
* ``Compute(step, inputs)``: run the step model over some requests' inputs; answer: one
  output dict each.

Each deployable drives it with its own way to run a model: the GPU service awaits each
step model's own batcher (``drive_async``), so concurrent pipeline requests batch per
step and pipelines that share a model batch together; the CPU fallback and the batch
job run the engine on their thread (``drive`` with ``LocalSteps``). Serving a request
with it (signature checks, responses, the batch job's model, a process's pipelines) is
``spillway.pipelines.serving``.

A step whose condition fails for a request, or that reads a tensor a skipped step would
have made, is skipped for it: the response leaves out the outputs it would have made and
names it in ``parameters.skipped_steps`` (``"<index>:<model>"``, comma-separated);
``parameters.cached_steps`` names the steps a response took from its own tenant's cache
(a run is for one tenant scope, ``spillway.state.table.scope``, which keys its entries;
a run whose tenant is unknown, ``None``, reads and writes no tenant's entries).
A step whose cache is shared across tenants is never named: whether someone else sent
the same inputs is not the caller's to learn.

A mapped step (``spillway.map``) runs over rows (``spillway.pipelines.fanout``): its
``Compute`` carries chunks of rows, at most the step model's ``max_batch_size`` each
(one row each for a model that does not batch), each chunk to be run on its own; it is
cached per row, and named as cached when every row of the request came from the cache.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from spillway.models.engine import OnnxModel
from spillway.models.processing import Prepared, Tensors
from spillway.pipelines import fanout
from spillway.pipelines.definition import Pipeline, Step
from spillway.pipelines.stepcache import SHARED_SCOPE, StepCache, cache_key
from spillway.protocol.errors import DeadlineExceededError, SpillwayError

T = TypeVar("T")


@dataclass(frozen=True)
class Resolve:
    """Which version of the step model will run? Answer: its number."""

    step: Step


@dataclass(frozen=True)
class Compute:
    """Run the step model over each of these inputs. Answer: one output dict each.
    A mapped step's inputs are chunks of rows, each at most the model's batch: a
    driver that runs inputs together must run each of those on its own."""

    step: Step
    inputs: list[Tensors]


@dataclass(frozen=True)
class CacheIO:
    """Call the cache. Answer: what ``call`` returns. ``blocking``: it may wait on the
    network, so an event loop runs it on a thread."""

    call: Callable[[], Any]
    blocking: bool


Effect = Resolve | Compute | CacheIO


@dataclass
class Outcome:
    """What a pipeline made for one request."""

    tensors: Tensors
    """The pipeline outputs made (a skipped step's are absent)."""
    skipped: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)


Run = Generator[Effect, Any, list[Outcome]]


@dataclass
class StepStats:
    """What one step did, over every request."""

    runs: int = 0
    """Requests the step ran for (computed or taken from the cache)."""
    rows: int = 0
    """Rows a mapped step ran over (computed or taken from the cache)."""
    executions: int = 0
    """Times the step model was asked to compute (one per request on a server, where
    the step model's batcher then batches them; one per batch of records in a job)."""
    skipped: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    compute_ns: int = 0


@dataclass
class PipelineStats:
    """What a pipeline did; counted on the thread (or event loop) that drives it."""

    steps: dict[int, StepStats] = field(default_factory=dict)
    success: int = 0
    failure: int = 0
    success_ns: int = 0
    failure_ns: int = 0
    rows: int = 0
    last_inference_ms: int = 0

    def step(self, index: int) -> StepStats:
        return self.steps.setdefault(index, StepStats())

    @contextlib.contextmanager
    def request(self, rows: int) -> Iterator[None]:
        """Count one request of ``rows`` rows: a success, or a failure if it raises."""
        started = time.perf_counter()
        try:
            yield
        except SpillwayError:
            self.failure += 1
            self.failure_ns += int((time.perf_counter() - started) * 1e9)
            raise
        self.success += 1
        self.success_ns += int((time.perf_counter() - started) * 1e9)
        self.rows += rows
        self.last_inference_ms = int(time.time() * 1000)

    def to_triton(self, pipeline: Pipeline, version: str) -> dict[str, Any]:
        """A ``model_stats`` entry in Triton's shape, per-step figures under ``spillway``."""
        steps = []
        for step in pipeline.steps:
            s = self.step(step.index)
            steps.append(
                {
                    "step": step.label,
                    "model_name": step.model,
                    "model_version": str(step.version or -1),
                    "runs": s.runs,
                    "rows": s.rows,
                    "executions": s.executions,
                    "skipped": s.skipped,
                    "cache_hits": s.cache_hits,
                    "cache_misses": s.cache_misses,
                    "compute_infer": {"count": s.executions, "ns": s.compute_ns},
                }
            )
        return {
            "name": pipeline.name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.rows,
            "execution_count": self.success,
            "inference_stats": {
                "success": {"count": self.success, "ns": self.success_ns},
                "fail": {"count": self.failure, "ns": self.failure_ns},
            },
            "batch_stats": [],
            "spillway": {"steps": steps},
        }


# --- the steps --------------------------------------------------------------------------


def run_steps(
    pipeline: Pipeline,
    requests: Sequence[Tensors],
    cache: StepCache | None,
    stats: PipelineStats,
    *,
    scope: str | None,
    clock: Callable[[], float] = time.perf_counter,
) -> Run:
    """Run every step over ``requests`` (their checked pipeline inputs, all of one tenant
    ``scope``); one ``Outcome`` each. Yields effects for the driver (see the module
    docstring)."""
    states = [dict(r) for r in requests]
    outcomes = [Outcome({}) for _ in requests]
    for step in pipeline.steps:
        yield from advance(step, states, outcomes, cache, stats, scope=scope, clock=clock)
    for outcome, state in zip(outcomes, states, strict=True):
        outcome.tensors = {n: state[n] for n in pipeline.output_names if n in state}
    return outcomes


def advance(
    step: Step,
    states: list[Tensors],
    outcomes: list[Outcome],
    cache: StepCache | None,
    stats: PipelineStats,
    *,
    scope: str | None,
    clock: Callable[[], float] = time.perf_counter,
) -> Generator[Effect, Any, None]:
    """One step over the requests' pipeline tensors (``states``, updated in place with
    what it makes) for callers of tenant ``scope``; skips and hits in the tenant's own
    cache are noted in their ``outcomes``."""
    counts = stats.step(step.index)
    active = [i for i, state in enumerate(states) if step.runs_on(state)]
    for i in range(len(states)):
        if i not in active:
            outcomes[i].skipped.append(step.label)
    counts.skipped += len(states) - len(active)
    if not active:
        return
    counts.runs += len(active)
    if step.fanout is not None:
        yield from _fan_out(
            step, step.fanout, states, outcomes, active, cache, counts, scope, clock
        )
        return
    inputs = [step.inputs_of(states[i]) for i in active]
    results = yield from _run_step(step, inputs, cache, counts, scope, clock)
    for i, (result, hit) in zip(active, results, strict=True):
        states[i].update(step.outputs_of(result))
        if hit and not step.cache_shared:
            outcomes[i].cached.append(step.label)


def _fan_out(
    step: Step,
    fan: fanout.FanOut,
    states: list[Tensors],
    outcomes: list[Outcome],
    active: list[int],
    cache: StepCache | None,
    counts: StepStats,
    scope: str | None,
    clock: Callable[[], float],
) -> Generator[Effect, Any, None]:
    """A mapped step: every active request's rows through the step model (and the
    cache, row by row), gathered back per request and item."""
    spreads = [fanout.spread(fan, states[i]) for i in active]
    units = [unit for spread in spreads for unit in spread.units]
    results = iter((yield from _run_step(step, units, cache, counts, scope, clock)))
    counts.rows += len(units)
    for i, spread in zip(active, spreads, strict=True):
        mine = [next(results) for _ in spread.units]
        states[i].update(step.outputs_of(fanout.gather(fan, spread, [r for r, _ in mine])))
        if mine and all(hit for _, hit in mine) and not step.cache_shared:
            outcomes[i].cached.append(step.label)


def _run_step(
    step: Step,
    inputs: list[Tensors],
    cache: StepCache | None,
    counts: StepStats,
    scope: str | None,
    clock: Callable[[], float],
) -> Generator[Effect, Any, list[tuple[Tensors, bool]]]:
    """One step over the inputs of the requests it runs for: each result and whether it
    came from the cache (the tenant's own, or the shared one of a public step)."""
    version: int = yield Resolve(step)
    found: list[Tensors | None] = [None] * len(inputs)
    keys: list[str] = []
    owner = SHARED_SCOPE if step.cache_shared else scope
    if step.cache and cache is not None and owner is not None and inputs:
        keys = [cache_key(owner, step.model, version, step.config_digest, x) for x in inputs]
        found = yield CacheIO(functools.partial(cache.get_many, keys), cache.blocking)
        hits = sum(entry is not None for entry in found)
        counts.cache_hits += hits
        counts.cache_misses += len(found) - hits
    missing = [j for j, entry in enumerate(found) if entry is None]
    computed: list[Tensors] = []
    if missing:
        started = clock()
        computed = yield from _compute(step, [inputs[j] for j in missing])
        counts.executions += 1
        counts.compute_ns += int((clock() - started) * 1e9)
        if keys and cache is not None:
            made = [(keys[j], out) for j, out in zip(missing, computed, strict=True)]
            yield CacheIO(functools.partial(cache.put_many, made), cache.blocking)
    fresh = iter(computed)
    return [(entry, True) if entry is not None else (next(fresh), False) for entry in found]


def _compute(step: Step, inputs: list[Tensors]) -> Generator[Effect, Any, list[Tensors]]:
    """The step model over ``inputs``: one output dict each (a mapped step's rows go in
    chunks, and come back one by one)."""
    if step.fanout is None:
        answers: list[Tensors] = yield Compute(step, inputs)
        return answers
    calls = fanout.chunks(step.fanout, inputs)
    return fanout.split(step.fanout, calls, (yield Compute(step, calls)))


def drive(run: Generator[Effect, Any, T], handle: Callable[[Effect], Any]) -> T:
    """Run the steps, answering each effect with ``handle`` on this thread."""
    try:
        effect = next(run)
        while True:
            effect = run.send(handle(effect))
    except StopIteration as done:
        result: T = done.value
        return result
    finally:
        run.close()


async def drive_async(
    run: Generator[Effect, Any, T], handle: Callable[[Effect], Awaitable[Any]]
) -> T:
    """Run the steps, awaiting ``handle`` for each effect."""
    try:
        effect = next(run)
        while True:
            effect = run.send(await handle(effect))
    except StopIteration as done:
        result: T = done.value
        return result
    finally:
        run.close()


Resolver = Callable[[str, str | None], OnnxModel]
"""A loaded step model by name and version (``None``: the one it serves)."""


class LocalSteps:
    """Answers effects on the calling thread with loaded engines (the CPU fallback, the
    batch job). ``deadline`` (a ``clock`` instant, ``time.monotonic()``'s by default)
    fails a step, or a mapped step's next chunk of rows, that would start after it with
    504, as the direct execute step does for a model: a request's work stops when its
    deadline passes, not when its last chunk is done."""

    def __init__(
        self,
        resolve: Resolver,
        deadline: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._resolve = resolve
        self._deadline = deadline
        self._clock = clock
        self._models: dict[int, OnnxModel] = {}

    def __call__(self, effect: Effect) -> Any:
        if isinstance(effect, Resolve):
            step = effect.step
            model = self._resolve(step.model, None if step.version is None else str(step.version))
            self._models[step.index] = model
            return model.version
        if isinstance(effect, Compute):
            model = self._models[effect.step.index]
            if effect.step.fanout is None:
                self._in_time("a step")
                return run_local(model, effect.inputs)
            outputs: list[Tensors] = []
            chunks = len(effect.inputs)
            for number, chunk in enumerate(effect.inputs, 1):  # a model's batch: one run each
                self._in_time(f"chunk {number} of {chunks} of step {effect.step.label}")
                outputs += run_local(model, [chunk])
            return outputs
        return effect.call()

    def _in_time(self, what: str) -> None:
        if self._deadline is not None and self._clock() > self._deadline:
            raise DeadlineExceededError(f"the request's timeout passed before {what} ran")


def run_local(model: OnnxModel, inputs: list[Tensors]) -> list[Tensors]:
    """One engine run over several requests' inputs (prepared together, e.g. one
    tokenising call); the first request's error is raised."""
    prepared: list[Prepared] = []
    for outcome in model.prepare_many(inputs):
        if isinstance(outcome, SpillwayError):
            raise outcome
        prepared.append(outcome)
    return model.run(prepared)
