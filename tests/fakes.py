"""Shared test fakes: a virtual-time event loop and an inline executor (timing code
without real time or threads), a summing batch runner, a model repository, model and
loader for the registry; and ``eventually``, the one way to wait on a process from outside."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, Future
from contextvars import Context
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, TypeVarTuple

import numpy as np

from gpu_service.settings import GpuSettings
from spillway.models.config import ModelConfig
from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import InferenceError, ModelLoadError, ModelNotFoundError

P = ParamSpec("P")
T = TypeVar("T")
Ts = TypeVarTuple("Ts")
MB = 1_000_000

# -- waiting on state only observable from outside ------------------------------------


def eventually(
    check: Callable[[], T | None], what: str, *, timeout_s: float = 60.0, interval_s: float = 0.02
) -> T:
    """Call ``check`` until it returns something truthy, and return that; fail with
    ``what`` after ``timeout_s``. For state another process exposes (metrics, logs, a job
    record): the interval only spaces the polls, the condition decides."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(interval_s)
    return result


# -- virtual time ----------------------------------------------------------------------


class StepClock:
    """A clock and an async sleep for code that takes both (the GPU registry's listing
    cadence): sleeping moves the clock at once, no time passes."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


# Loop iterations an ``idle()`` waiter may wait through before the loop is called busy.
SPIN_LIMIT = 100_000


class _JumpingSelector(selectors.DefaultSelector):
    """Polls for I/O without blocking; when nothing can run, wakes ``idle()`` waiters
    first, and only then jumps the loop's clock to its next timer."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop
        self._busy = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        loop = self._loop
        if events or timeout == 0:
            self._busy = self._busy + 1 if loop.awaits_idle else 0
            if self._busy > SPIN_LIMIT:
                raise RuntimeError(f"the loop never went idle in {SPIN_LIMIT} steps: a busy loop")
            return events
        self._busy = 0
        if loop.wake_idle():
            return []
        if timeout is None:
            raise RuntimeError("virtual-time loop: nothing can run and no timer is set")
        loop.jump(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual, starting at 0: when nothing is ready to
    run it jumps to the next timer instead of waiting. Timing code runs at once and the
    same way every time, provided all its work happens on the loop (no threads: use
    ``InlineExecutor``). Waiting on nothing at all, or never going idle while a test
    waits in ``idle()``, raises instead of hanging."""

    def __init__(self) -> None:
        self._now = 0.0
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._order = itertools.count()
        self._idle: list[asyncio.Future[None]] = []
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def call_at(
        self,
        when: float,
        callback: Callable[[*Ts], object],
        *args: *Ts,
        context: Context | None = None,
    ) -> asyncio.TimerHandle:
        # The base loop runs a timer up to its clock resolution early; on this clock that
        # would be a moment early forever, so a timer moves the clock to its own time.
        handle = super().call_at(when, self._fire, when, callback, *args, context=context)
        heapq.heappush(self._timers, (when, next(self._order), handle))
        return handle

    def _fire(self, when: float, callback: Callable[[*Ts], object], *args: *Ts) -> None:
        self._now = max(self._now, when)
        callback(*args)

    def jump(self, timeout: float) -> None:
        """Move the clock to the next live timer (``timeout`` ahead if none is known)."""
        while self._timers and (self._timers[0][2].cancelled() or self._timers[0][0] <= self._now):
            heapq.heappop(self._timers)
        self._now = self._timers[0][0] if self._timers else self._now + timeout

    @property
    def awaits_idle(self) -> bool:
        """Someone waits in ``idle()``."""
        return bool(self._idle)

    def wake_idle(self) -> bool:
        """Resolve the ``idle()`` waiters; False when there were none."""
        waiters, self._idle = self._idle, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        return bool(waiters)

    async def idle(self) -> None:
        """Return once everything that can run without time passing has run."""
        waiter = self.create_future()
        self._idle.append(waiter)
        await waiter


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``main()`` on a fresh ``VirtualTimeLoop``."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main())


def virtual_loop() -> VirtualTimeLoop:
    """The running loop, which must be a ``VirtualTimeLoop``."""
    loop = asyncio.get_running_loop()
    if not isinstance(loop, VirtualTimeLoop):
        raise RuntimeError("this helper needs a VirtualTimeLoop (use run_virtual)")
    return loop


async def idle() -> None:
    """Let everything that can run without time passing run."""
    await virtual_loop().idle()


async def advance(seconds: float) -> None:
    """Let ``seconds`` of virtual time pass, running whatever falls due meanwhile."""
    virtual_loop()
    await asyncio.sleep(seconds)  # virtual: the loop jumps, nothing really waits


class InlineExecutor(Executor):
    """Runs each submitted call on the caller's thread — at once, or while ``hold()`` is
    in force, when the test releases it — and delivers its outcome ``run_s`` virtual
    seconds later, as if computing took that long. A held call is "running": submitted,
    not finished."""

    def __init__(self, run_s: float = 0.0) -> None:
        self.run_s = run_s
        self.holding = False
        self.held: list[tuple[Callable[[], Any], Future[Any]]] = []
        self.calls = 0

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        call = (lambda: fn(*args, **kwargs), future)
        if self.holding:
            self.held.append(call)
        else:
            self._run(*call)
        return future

    def hold(self) -> None:
        """Keep calls submitted from now on until they are released."""
        self.holding = True

    def release(self, count: int | None = None) -> None:
        """Run the first ``count`` held calls (all when None)."""
        calls = self.held[:count] if count is not None else self.held[:]
        del self.held[: len(calls)]
        for call in calls:
            self._run(*call)

    def resume(self) -> None:
        """Stop holding and run every held call."""
        self.holding = False
        self.release()

    def _run(self, fn: Callable[[], Any], future: Future[Any]) -> None:
        self.calls += 1
        try:
            result = fn()
        except Exception as error:  # noqa: BLE001 - delivered to the caller, like a pool
            self._deliver(future.set_exception, error)
        else:
            self._deliver(future.set_result, result)

    def _deliver(self, settle: Callable[[Any], None], value: Any) -> None:
        if self.run_s:
            asyncio.get_running_loop().call_later(self.run_s, settle, value)
        else:
            settle(value)


# -- a batch runner --------------------------------------------------------------------


def fake_request(ident: int, rows: int = 1, *, poison: bool = False, length: int = 0) -> Prepared:
    """``rows`` rows of 3 values tagged with ``ident``; a poison row is negative."""
    x = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) + ident * 100
    if poison:
        x[0, 0] = -1
    return Prepared({"x": x, "id": np.full((rows, 1), ident)}, rows, length)


def row_sums(prepared: Prepared) -> np.ndarray:
    """What ``SummingRunner`` answers for one request run alone."""
    return np.asarray(prepared.feeds["x"].sum(axis=1, keepdims=True))


@dataclass
class SummingRunner:
    """Sums each row of ``fake_request``s; records each batch as its request ids; fails a
    batch that holds a poison row."""

    batches: list[list[int]] = field(default_factory=list)

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        self.batches.append([int(p.feeds["id"][0, 0]) for p in batch])
        return sum_rows(batch)


def sum_rows(batch: list[Prepared]) -> list[Tensors]:
    """One run of a summing model: ``y`` = the sum of each row of ``x``, split back per
    request; a batch holding a negative value fails whole, as a runtime error would."""
    x = np.concatenate([p.feeds["x"] for p in batch])
    if (x < 0).any():
        raise InferenceError("poison row in batch")
    out = x.sum(axis=1, keepdims=True)
    results, start = [], 0
    for p in batch:
        results.append({"y": out[start : start + p.rows]})
        start += p.rows
    return results


# -- a model repository, models and a loader for the registry --------------------------


def tensor_config(name: str, **block: Any) -> ModelConfig:
    """A one-input, one-output FP32 model config; ``block`` goes to its ``spillway`` part."""
    spec = {"data_type": "TYPE_FP32", "dims": [1]}
    return ModelConfig(
        name=name,
        max_batch_size=4,
        input=[{"name": "x", **spec}],
        output=[{"name": "y", **spec}],
        dynamic_batching={"max_queue_delay_microseconds": 0},
        spillway={"kind": "tensor", **block},
    )


@dataclass
class FakeRepository:
    """Models in memory; a fetched version is a folder with a one-byte model file."""

    root: Path
    configs: dict[str, ModelConfig] = field(default_factory=dict)
    versions: dict[str, list[int]] = field(default_factory=dict)
    location: str = "memory"

    def add(self, name: str, *versions: int, **block: Any) -> None:
        self.configs[name] = tensor_config(name, **block)
        self.versions.setdefault(name, []).extend(versions)

    def list_models(self) -> list[str]:
        return sorted(self.configs)

    def list_versions(self, model: str) -> list[int]:
        return sorted(self.versions[model])

    def read_config(self, model: str) -> ModelConfig:
        if model not in self.configs:
            raise ModelNotFoundError(model)
        return self.configs[model]

    def fetch_version(self, model: str, version: int, cache_dir: Path) -> Path:
        path = self.root / model / str(version)
        path.mkdir(parents=True, exist_ok=True)
        (path / "model.onnx").write_bytes(b"x")
        return path

    def publish_version(
        self, model: str, files: Any, config: Any = None, *, version: int | None = None
    ) -> int:
        raise NotImplementedError


@dataclass
class FakeModel:
    """Adds the version number to each row, so a response names who computed it."""

    name: str
    version: int
    config: ModelConfig
    provider: str = "fake"
    provider_fallback: bool = False

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        return [{"y": p.feeds["x"] + self.version} for p in batch]

    def prepare(self, inputs: Tensors) -> Prepared:
        return Prepared(inputs, 1)


@dataclass
class FakeLoader:
    """Loads ``FakeModel``s of a fixed footprint; fails the versions in ``broken``; records
    its calls. With a ``gate``, each load waits (on its worker thread) until it is set."""

    footprint: int = 40 * MB
    broken: set[tuple[str, int]] = field(default_factory=set)
    calls: list[tuple[str, int]] = field(default_factory=list)
    gate: threading.Event | None = None

    def __call__(
        self, cfg: ModelConfig, version: int, path: Path, settings: GpuSettings
    ) -> tuple[Any, int, str]:
        self.calls.append((cfg.name, version))
        if self.gate is not None and not self.gate.wait(30):
            raise ModelLoadError("the test never opened the loader's gate")
        if (cfg.name, version) in self.broken:
            raise ModelLoadError(f"{cfg.name} v{version} failed warm-up")
        return FakeModel(cfg.name, version, cfg), self.footprint, "fake"
