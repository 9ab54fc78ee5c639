"""The model registry: versions, hot swap, memory budget, scale-to-zero, lazy loads.

All registry state lives on the event loop; fetching, session creation and warm-up run on
worker threads. Loads are serialised (one at a time) so memory growth is attributable.

* ``sync(model)`` brings a model in line with its repository and version policy: new
  versions are fetched, verified, loaded and warmed **beside** the serving one; once a new
  version is ready the switch is atomic (requests pick the newest ready version), and old
  versions drain their leases before they are freed. A version that fails to load never
  replaces a serving one; the failure is reported to the caller and counted.
* A load that does not fit ``memory_budget_mb`` evicts least-recently-used idle versions
  of other models; a busy version is never evicted; if nothing can be freed the load fails
  with ``InsufficientMemoryError``.
* A version idle longer than its TTL is unloaded (unless its model is pinned); the next
  request loads it again, and concurrent first requests share that one load.
* A pipeline is an entry like a model's: ``sync`` checks it instead of loading
  versions, and ``find`` answers its name, as a model's, with something behind one
  interface (``gpu_service.served.Served``).
* A request for a name the registry does not know lists the repository again (one
  listing at a time, at most one per ``MISS_LIST_S`` whatever names are asked, shared by
  every miss that comes before it begins; nothing a request names is kept): a model
  published since the last listing is registered, and loaded as a model scaled to zero
  is, without the poll or a load request. An infer request that misses (``lookup``)
  waits for a listing that begins after it asked, up to its deadline and
  ``MISS_WAIT_S``, then is looked up again: the first request after a model is
  published is served by it; a name the listing did not find (or a listing that failed
  or took longer) is a 404. Metadata, ready, config and stats look-ups do the same,
  unless a listing began less than ``MISS_LIST_S`` ago: that listing answers for them,
  so a client asking about names that do not exist gets its 404s at once, not one a
  second. Other look-ups (``entry``, ``find``) answer at once: their miss is a 404 and
  starts the listing in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from gpu_service.batching_policy import batching_policy
from gpu_service.compute_budget import ComputeBudget, limit_library_threads
from gpu_service.memory import estimate
from gpu_service.pipelines import Pipelines
from gpu_service.served import ModelEntry, ModelVersions, Served
from gpu_service.settings import GpuSettings
from gpu_service.versions import ServedVersion, State, load_version, start_version
from spillway.models.config import ModelConfig
from spillway.models.engine import OnnxModel
from spillway.models.loader import chosen_versions
from spillway.models.repository import ModelRepository
from spillway.protocol.errors import (
    InsufficientMemoryError,
    ModelNotFoundError,
    ModelNotReadyError,
    SpillwayError,
)
from spillway.protocol.names import validate_model_name, validate_version

log = logging.getLogger("spillway.registry")

# Creates and warms a session; returns it with its measured footprint and the method used.
Loader = Callable[[ModelConfig, int, Path, GpuSettings], tuple[OnnxModel, int, str]]

MISS_LIST_S = 1.0
"""The repository is listed again for an unknown name at most this often."""
MISS_WAIT_S = 2.0
"""The longest an infer request for an unknown name waits for that listing (a second
until the next one may begin, and the listing itself) before its 404."""


class ModelRegistry:
    """Loads, swaps, evicts and finds model versions; checks and finds pipelines."""

    def __init__(
        self,
        repository: ModelRepository,
        settings: GpuSettings,
        *,
        loader: Loader = load_version,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.repository = repository
        self.settings = settings
        self._loader = loader
        self.clock = clock
        self._sleep = sleep
        self.models: dict[str, ModelEntry] = {}
        threads, slots = settings.compute_layout()
        self.budget = ComputeBudget(
            slots,
            overdraft=settings.compute_overdraft,
            short_run_s=settings.short_run_ms / 1e3,
            steps=not settings.on_gpu,
            wide=settings.wide_threads() > threads,
        )
        """The device's compute: every version's runs (and CPU steps) share it."""
        limit_library_threads(threads)
        log.info("compute budget: %d slots of %d thread(s) each", slots, threads)
        self.pipelines = Pipelines.from_env(self)
        self._load_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self.listing: asyncio.Task[None] | None = None
        """The listing a miss asked for last (begun or waiting to begin)."""
        self._listing_begun = False
        self._listings: set[asyncio.Task[None]] = set()
        self._listed_at = -math.inf

    # -- start and stop --------------------------------------------------------------------

    async def start(self) -> None:
        """Register the repository's models, load the start-up set, start background tasks."""
        self._listed_at = self.clock()
        names = await asyncio.to_thread(self.repository.list_models)
        wanted = self.settings.startup_models
        for name in names:
            entry = self.models.setdefault(name, ModelEntry(name))
            if "*" in wanted or name in wanted:
                for failure in await self.sync(name):
                    log.error("model %s: %s", name, failure.message)
            else:
                entry.config = await asyncio.to_thread(self.repository.read_config, name)
        # What start-up made (sessions, tokenizers, configs) lives as long as the service:
        # out of the collector's sight, a full collection under load walks only what the
        # requests made, instead of stalling the event loop for tens of milliseconds.
        gc.freeze()
        loop = asyncio.get_running_loop()
        if self.settings.model_control_mode == "poll":
            self._tasks.append(loop.create_task(self._poll(), name="repository-poll"))
        self._tasks.append(loop.create_task(self._reap(), name="idle-reaper"))

    async def stop(self, drain_timeout_s: float) -> None:
        """Stop background work and drain every version."""
        for task in [*self._tasks, *self._listings]:
            task.cancel()
        served = [v for e in self.models.values() for v in e.versions.values()]
        await asyncio.gather(*(v.drain(drain_timeout_s) for v in served))
        self.budget.close()

    # -- finding a version -----------------------------------------------------------------

    def entry(self, name: str) -> ModelEntry:
        """A model known to the registry (404 otherwise)."""
        # Only validated names are ever keys: a hit needs no check (every request asks).
        entry = self.models.get(name) or self.models.get(validate_model_name(name))
        if entry is None:
            self._list_again()
            raise ModelNotFoundError.unknown(name, self.models)
        return entry

    def known(self, name: str) -> bool:
        """Whether the registry knows ``name`` now (400 for an invalid name); one it does
        not know is for ``lookup``."""
        return name in self.models or validate_model_name(name) in self.models

    async def lookup(
        self, name: str, timeout_s: float | None = None, *, listed_within_s: float = 0.0
    ) -> Served:
        """``find`` for an infer request: a name the registry does not know waits for a
        listing of the repository that begins after it asked (at most half ``timeout_s``,
        so its 404 still reaches the caller in time, and ``MISS_WAIT_S``), then is looked
        up again (404 if it is still unknown). With
        ``listed_within_s``, a listing that began that recently answers for it: the miss
        is a 404 at once (and starts the next listing in the background)."""
        entry = self.models.get(name)
        if entry is None:
            key = validate_model_name(name)
            recent = self.clock() - self._listed_at < listed_within_s
            if key not in self.models and not recent and (listing := self._list_again()):
                # Half the request's time at most: its 404 must still reach the caller
                # (a router relaying it) before the request's deadline.
                wait_s = MISS_WAIT_S if timeout_s is None else min(timeout_s / 2, MISS_WAIT_S)
                # Not wait_for: a listing that takes longer goes on for the next miss.
                await asyncio.wait({listing}, timeout=wait_s)
            entry = self.models.get(key)
            if entry is None:
                if recent:
                    self._list_again()
                raise ModelNotFoundError.unknown(name, self.models)
        return self._served(entry)

    def _list_again(self) -> asyncio.Task[None] | None:
        """The listing that answers a miss now: the one waiting to begin (every miss
        until it begins shares it), else a new one, which begins once the last one has
        ended and ``MISS_LIST_S`` after it began (``None`` outside the service's loop)."""
        if self.listing is not None and not self._listing_begun:
            return self.listing
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the service's loop: nothing to start
            return None
        self._listing_begun = False
        self.listing = loop.create_task(self._register_new(self.listing), name="repository-miss")
        self._listings.add(self.listing)
        self.listing.add_done_callback(self._listings.discard)
        return self.listing

    async def _register_new(self, previous: asyncio.Task[None] | None) -> None:
        """Once its turn comes, register the repository's models the registry does not
        know: their configuration read, their versions loaded by their first request."""
        if previous is not None and not previous.done():
            await asyncio.wait({previous})  # one at a time (its failure is its own)
        delay_s = self._listed_at + MISS_LIST_S - self.clock()
        if delay_s > 0:
            await self._sleep(delay_s)
        self._listed_at = self.clock()
        self._listing_begun = True
        try:
            names = await asyncio.to_thread(self.repository.list_models)
        except SpillwayError as error:
            log.warning("listing the repository after a miss failed: %s", error.message)
            return
        for name in names:
            if name in self.models:
                continue
            try:
                config = await asyncio.to_thread(self.repository.read_config, name)
            except SpillwayError as error:
                log.warning("model %s: %s", name, error.message)
                continue
            entry = self.models.setdefault(name, ModelEntry(name))
            entry.config = entry.config or config
            log.info("model %s found in the repository; its first request loads it", name)

    def find(self, name: str) -> Served:
        """What serves ``name``: a model's versions or a pipeline, behind one interface
        (404 for a name the registry does not know)."""
        return self._served(self.entry(name))

    def _served(self, entry: ModelEntry) -> Served:
        return self.pipelines.entry(entry) if entry.is_pipeline else ModelVersions(self, entry)

    def get(self, name: str, version: str | None = None) -> ServedVersion:
        """The version that serves now: the pinned one, or the newest ready one."""
        entry = self.entry(name)
        if version is not None:
            number = validate_version(version)
            served = entry.versions.get(number)
            if served is None:
                raise ModelNotFoundError(f"model {name!r} has no version {number} loaded")
            if not served.ready:
                raise self._not_ready(entry, f"version {number} is not ready")
            return served
        served = entry.serving()
        if served is None:
            raise self._not_ready(entry, "no version is ready")
        return served

    def _not_ready(self, entry: ModelEntry, what: str) -> ModelNotReadyError:
        reason = f" ({entry.last_error})" if entry.last_error else ""
        return ModelNotReadyError(
            f"model {entry.name!r}: {what}{reason}", retry_after_s=self.settings.retry_after_s
        )

    @contextlib.asynccontextmanager
    async def lease(
        self, name: str, version: str | None, timeout_s: float | None
    ) -> AsyncIterator[tuple[ServedVersion, float | None]]:
        """Hold a version for one request, loading it first if it was scaled to zero.

        Yields the version and the seconds this request waited for a cold start (or None).
        """
        served, cold = await self.acquire(name, version, timeout_s)
        try:
            yield served, cold
        finally:
            served.release()

    async def acquire(
        self, name: str, version: str | None, timeout_s: float | None
    ) -> tuple[ServedVersion, float | None]:
        """``lease`` without the context manager, for the infer path (the caller calls
        ``served.release()``): the version, held, and the cold-start seconds (or None)."""
        entry = self.entry(name)
        cold: float | None = None
        served = entry.serving() if version is None else None
        if served is None:
            if version is None and entry.config is not None:
                started = time.monotonic()
                await self._cold_start(entry, timeout_s or self.settings.cold_start_timeout_s)
                cold = time.monotonic() - started
            served = self.get(name, version)
        served.acquire()
        return served, cold

    async def _cold_start(self, entry: ModelEntry, timeout_s: float) -> None:
        if entry.loading is None or entry.loading.done():
            entry.cold_starts += 1
            entry.loading = asyncio.get_running_loop().create_task(self.sync(entry.name))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(entry.loading), timeout_s)

    # -- loading and unloading -------------------------------------------------------------

    async def sync(self, name: str) -> list[SpillwayError]:
        """Load the versions the policy wants, then retire the others; the failures."""
        entry = self.models.setdefault(validate_model_name(name), ModelEntry(name))
        async with entry.lock:
            try:
                entry.config = await asyncio.to_thread(self.repository.read_config, name)
                available = await asyncio.to_thread(self.repository.list_versions, name)
            except SpillwayError as error:
                entry.last_error = error.message
                if isinstance(error, ModelNotFoundError) and not entry.versions:
                    self.models.pop(name, None)  # never known: requests get 404, not 503
                return [error]
            if entry.is_pipeline:
                return await self.pipelines.sync(entry, entry.config, available)
            wanted = chosen_versions(entry.config.version_policy, available)
            failures: list[SpillwayError] = []
            for number in wanted:
                if number not in entry.versions:
                    failure = await self._load(entry, entry.config, number)
                    if failure is not None:
                        failures.append(failure)
            if any(entry.versions[n].ready for n in wanted if n in entry.versions):
                for number in [n for n in entry.versions if n not in wanted]:
                    await self._retire(entry, number, "replaced by a newer version")
            if not failures:
                entry.last_error = None
            return failures

    async def _load(
        self, entry: ModelEntry, config: ModelConfig, number: int
    ) -> SpillwayError | None:
        entry.set_state(number, State.LOADING)
        started = time.monotonic()
        try:
            async with self._load_lock:
                path = await asyncio.to_thread(
                    self.repository.fetch_version, config.name, number, self.settings.cache_dir
                )
                await self._make_room(estimate(path, entry.footprint), entry.name)
                model, footprint, method = await asyncio.to_thread(
                    self._loader, config, number, path, self.settings
                )
                entry.footprint = footprint
                # The estimate was a guess: make room for what the load really took.
                await self._make_room(footprint, entry.name)
            policy = batching_policy(config, self.settings)
            served = start_version(model, policy, footprint, method, started, self.budget)
        except SpillwayError as error:
            entry.load_failures += 1
            entry.last_error = f"version {number}: {error.message}"
            entry.set_state(number, State.UNAVAILABLE, error.message)
            log.error("model %s v%d failed to load: %s", config.name, number, error.message)
            return error
        entry.versions[number] = served
        entry.set_state(number, State.READY)
        entry.loads += 1
        log.info(
            "loaded %s v%d on %s in %.2f s, %.1f MB (%s)",
            config.name,
            number,
            model.provider,
            served.load_seconds,
            footprint / 1e6,
            method,
        )
        return None

    async def _retire(self, entry: ModelEntry, number: int, reason: str) -> None:
        served = entry.versions.get(number)
        if served is None:
            return
        served.retiring = True
        entry.set_state(number, State.UNLOADING, reason)
        await served.drain(self.settings.drain_timeout_s)
        entry.versions.pop(number, None)
        entry.set_state(number, State.UNAVAILABLE, f"unloaded: {reason}")
        log.info("unloaded %s v%d: %s", entry.name, number, reason)

    async def unload(self, name: str, reason: str = "unloaded on request") -> None:
        """Drain and free every version of a model (a pipeline stops being served)."""
        entry = self.entry(name)
        async with entry.lock:
            self.pipelines.unload(entry, reason)
            for number in list(entry.versions):
                await self._retire(entry, number, reason)

    async def _make_room(self, needed: int, loading: str) -> None:
        budget = self.settings.memory_budget_mb
        if budget is None:
            return
        limit = int(budget * 1e6)
        while self.memory_in_use() + needed > limit:
            idle = [
                (v.last_used, e, n)
                for e in self.models.values()
                if e.name != loading and not (e.config and e.config.spillway.pinned)
                for n, v in e.versions.items()
                if v.idle and not v.retiring
            ]
            if not idle:
                raise InsufficientMemoryError(
                    f"{needed / 1e6:.1f} MB do not fit the {budget:g} MB budget "
                    f"({self.memory_in_use() / 1e6:.1f} MB in use by busy or pinned models)",
                    retry_after_s=self.settings.retry_after_s,
                )
            _, victim, number = min(idle, key=lambda item: item[0])
            victim.evictions += 1
            await self._retire(victim, number, "evicted to make room")

    def memory_in_use(self) -> int:
        """Summed footprint of every loaded version."""
        return sum(v.footprint for e in self.models.values() for v in e.versions.values())

    # -- background ------------------------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.settings.repository_poll_secs)
            try:
                names = set(await asyncio.to_thread(self.repository.list_models))
            except SpillwayError as error:
                log.warning("repository poll failed: %s", error.message)
                continue
            for name in sorted(names):
                for failure in await self.sync(name):
                    log.error("poll: model %s: %s", name, failure.message)
            for gone in set(self.models) - names:
                await self.unload(gone, "removed from the repository")

    async def _reap(self) -> None:
        while True:
            ttls = [t for e in self.models.values() if (t := e.ttl(self.settings.idle_ttl_s))]
            await asyncio.sleep(min([*ttls, 4.0]) / 4)
            await self.reap_idle(time.monotonic())

    async def reap_idle(self, now: float) -> None:
        """Unload every version idle for longer than its model's TTL at ``now`` (monotonic)."""
        for entry in list(self.models.values()):
            ttl = entry.ttl(self.settings.idle_ttl_s)
            for number, served in list(entry.versions.items()):
                if ttl and served.idle and now - served.last_used > ttl:
                    await self._retire(entry, number, f"idle for more than {ttl:g} s")

    # -- reporting -------------------------------------------------------------------------

    async def index(self) -> list[dict[str, str]]:
        """The repository index: every model and version with its state and reason."""
        names = set(await asyncio.to_thread(self.repository.list_models)) | set(self.models)
        rows = []
        for name in sorted(names):
            entry = self.models.get(name)
            if entry is None or not entry.states:
                rows.append(
                    {
                        "name": name,
                        "version": "",
                        "state": State.UNAVAILABLE.value,
                        "reason": (entry and entry.last_error) or "not loaded",
                    }
                )
                continue
            for number, (state, reason) in sorted(entry.states.items()):
                rows.append(
                    {"name": name, "version": str(number), "state": state.value, "reason": reason}
                )
        return rows

    def all_versions(self) -> list[ServedVersion]:
        """Every loaded version, by model name then version."""
        return [e.versions[v] for _, e in sorted(self.models.items()) for v in sorted(e.versions)]

    def all_stats(self) -> list[dict[str, Any]]:
        """Triton's ``model_stats`` of every loaded version, then of every pipeline."""
        return [s.triton_stats() for s in self.all_versions()] + self.pipelines.stats()

    @property
    def ready(self) -> bool:
        """Every model that should be resident has a ready version."""
        startup = self.settings.startup_models
        required = [
            e
            for e in self.models.values()
            if ("*" in startup or e.name in startup) and e.ttl(self.settings.idle_ttl_s) is None
        ]
        return bool(self.models) and all(self._served(e).ready(None) for e in required)
