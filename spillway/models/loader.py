"""Loading model versions, one way for every deployable.

The GPU service, the CPU fallback and the batch job all load through here: the model's
``version_policy`` picks the versions, the repository fetches and verifies every file
against its ``SHA256SUMS``, and each session is warmed before it takes a request.

``OnDemandVersions`` is the synchronous form the CPU fallback serves from: the models of
the repository and the versions each one's policy serves are read again once per
``refresh_s``, and sooner when a request names what the last read lacked (a model: the
repository is listed again; a version: the model's versions are read again), at most
once per ``miss_refresh_s``, with concurrent requests sharing one read; a served version
that is not loaded yet is loaded by the request that first asks for it: one load per
version however many requests wait for it (single flight), loads one at a time, every
file verified, and within a memory budget that evicts the least recently used versions
first.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar, cast

from spillway.models.config import ModelConfig, VersionPolicy
from spillway.models.engine import CPU, EngineOptions, OnnxModel
from spillway.models.repository import ModelRepository
from spillway.protocol.errors import InsufficientMemoryError, ModelNotFoundError, SpillwayError
from spillway.protocol.names import validate_model_name

log = logging.getLogger("spillway.loader")


def chosen_versions(policy: VersionPolicy, available: list[int]) -> list[int]:
    """The versions a Triton version policy selects from those available (ascending)."""
    if policy.specific is not None:
        return [v for v in policy.specific["versions"] if v in available]
    if policy.all is not None:
        return list(available)
    count = policy.latest["num_versions"] if policy.latest else 1
    return available[-count:]


def served_versions(repository: ModelRepository, name: str) -> tuple[ModelConfig, list[int]]:
    """A model's configuration and the versions its policy serves; 404 if there are none."""
    config = repository.read_config(validate_model_name(name))
    versions = chosen_versions(config.version_policy, repository.list_versions(name))
    if not versions:
        raise ModelNotFoundError(
            f"model {name!r} has no version its version_policy serves in {repository.location}"
        )
    return config, versions


def warm_up(model: OnnxModel) -> None:
    """Run the shapes a version will be asked for before it takes a request, so that a
    version that cannot run them fails its load instead of a client's request.

    On an accelerator each shape class is also initialised there (kernels and their
    algorithms are chosen per input shape): one row through every length (or width)
    bucket and the widest row, then a full batch through the shortest. ONNX Runtime's CPU
    provider keeps no state per shape (a shape's first run costs what its later runs do),
    so on the CPU only the check is worth its time: one row through the shortest and the
    longest, and two rows through the shortest for a batching model (a batch dimension
    that is not dynamic fails on them as on a full batch, whose working memory would
    otherwise be held from start-up)."""
    block = model.config.spillway
    lengths = [max(1, edge - 2) for edge in block.batch_buckets] or [8]
    if block.image is not None and block.image.max_width is not None:
        lengths.append(block.image.max_width)  # rows wider than every bucket
    rows = model.config.max_batch_size
    if model.provider == CPU:
        lengths = list(dict.fromkeys((lengths[0], lengths[-1])))
        rows = min(rows, 2)
    for length in lengths:
        model.infer(model.sample_inputs(1, length=length))
    if rows > 1:
        model.infer(model.sample_inputs(rows, length=lengths[0]))
    if model.wide:  # the same graph, other threads: one run proves it
        model.run([model.prepare(model.sample_inputs(1, length=lengths[0]))], wide=True)


def open_version(
    config: ModelConfig, version: int, path: Path, options: EngineOptions
) -> OnnxModel:
    """A session over a fetched, verified version folder, warmed up; blocking."""
    model = OnnxModel(config.name, version, config, path, options)
    warm_up(model)
    return model


def load_version(
    repository: ModelRepository,
    config: ModelConfig,
    version: int,
    cache_dir: Path,
    options: EngineOptions,
) -> OnnxModel:
    """Fetch (verifying checksums), open and warm one version; blocking."""
    started = time.monotonic()
    path = repository.fetch_version(config.name, version, cache_dir)
    model = open_version(config, version, path, options)
    log.info(
        "loaded %s v%d on %s in %.2f s",
        config.name,
        version,
        model.provider,
        time.monotonic() - started,
    )
    return model


def load_served(
    repository: ModelRepository,
    names: list[str] | None,
    cache_dir: Path,
    options: EngineOptions,
) -> dict[str, dict[int, OnnxModel]]:
    """Every version each model's policy serves (all models when ``names`` is ``None``);
    pipelines are not models to load (``spillway.pipelines.graph`` serves them over these)."""
    loaded: dict[str, dict[int, OnnxModel]] = {}
    for name in repository.list_models() if names is None else names:
        config, versions = served_versions(repository, name)
        if config.is_pipeline:
            continue
        loaded[name] = {
            v: load_version(repository, config, v, cache_dir, options) for v in versions
        }
    return loaded


FOOTPRINT_FACTOR = 1.5
"""A version's memory before it is loaded: its files' size times this (a session holds
the weights and ONNX Runtime's arenas around them)."""

Opener = Callable[[ModelConfig, int, Path], OnnxModel]


def file_footprint(path: Path) -> int:
    """The memory a fetched version folder is expected to take once loaded."""
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return int(size * FOOTPRINT_FACTOR)


@dataclass(frozen=True)
class VersionIndex:
    """A model's configuration and the versions its policy serves, as last read."""

    config: ModelConfig
    versions: tuple[int, ...]
    read_at: float

    def default(self) -> int:
        """The version a request that pins none gets (the stable one under a canary)."""
        return self.config.default_version(self.versions) or max(self.versions)


@dataclass(frozen=True)
class _Listing:
    """The repository's models, as last listed."""

    names: frozenset[str]
    read_at: float


@dataclass
class _Loaded:
    model: OnnxModel
    footprint: int


T = TypeVar("T")


@dataclass
class _Flight:
    """One read under way; its result (or error) is every waiting caller's."""

    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class SingleFlight:
    """One call per key at a time: a caller that finds a call under way for its key waits
    for it and takes its result (or its error) instead of making its own."""

    def __init__(self) -> None:
        self._calls: dict[str, _Flight] = {}
        self._lock = threading.Lock()

    def run(self, key: str, call: Callable[[], T]) -> T:
        """``call()``'s result, or that of the call for ``key`` already under way."""
        with self._lock:
            flight = self._calls.get(key)
            leader = flight is None
            if flight is None:
                flight = self._calls[key] = _Flight()
        if not leader:
            flight.done.wait()  # the leader's read is bounded by the repository's timeouts
            if flight.error is not None:
                raise flight.error
            return cast(T, flight.result)
        try:
            result = flight.result = call()
        except BaseException as error:
            flight.error = error
            raise
        else:
            return result
        finally:
            with self._lock:
                del self._calls[key]
            flight.done.set()


_LISTING = ""
"""The single-flight key of a repository listing (no model name is empty)."""


class OnDemandVersions:
    """The versions of ``names`` (``None``: every model of the repository) that their
    policies serve, each loaded on first use and kept within ``memory_budget_bytes``
    (``None``: unbounded). Without a repository it serves the ``preloaded`` versions.

    What a request may make it read: a name the last listing lacks lists the repository
    again, at most once per ``miss_refresh_s`` whatever names are asked (one listing
    answers for every name, and no name a request invents is kept, so a client asking
    for names that do not exist costs at most that); a listed model's versions are read
    again, when a request names one the last read lacked or the model had none served,
    at most once per ``miss_refresh_s`` per model. Concurrent requests that need the same
    read share it. Nothing read depends on who asked: the repository is one for every
    tenant, so no tenant's requests can hide a model from another for longer than
    ``miss_refresh_s``."""

    def __init__(
        self,
        repository: ModelRepository | None,
        names: Iterable[str] | None,
        *,
        cache_dir: Path,
        options: EngineOptions,
        refresh_s: float = 60.0,
        miss_refresh_s: float = 1.0,
        memory_budget_bytes: int | None = None,
        opener: Opener | None = None,
        clock: Callable[[], float] = time.monotonic,
        preloaded: Mapping[str, Mapping[int, OnnxModel]] | None = None,
    ) -> None:
        self.repository = repository
        self.names = None if names is None else frozenset(names)
        self.cache_dir = cache_dir
        self._open = opener or (lambda c, n, p: open_version(c, n, p, options))
        self.refresh_s = refresh_s
        self.miss_refresh_s = miss_refresh_s
        self.memory_budget_bytes = memory_budget_bytes
        self.clock = clock
        self._indexes: dict[str, VersionIndex] = {}
        self._unserved: dict[str, tuple[float, ModelNotFoundError]] = {}
        self._listing: _Listing | None = None
        self._reads = SingleFlight()
        self._loaded: OrderedDict[tuple[str, int], _Loaded] = OrderedDict()
        self._flights: dict[tuple[str, int], threading.Lock] = {}
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self.loads = 0
        self.evictions = 0
        for name, versions in (preloaded or {}).items():
            config = next(iter(versions.values())).config
            self._indexes[name] = VersionIndex(config, tuple(sorted(versions)), math.inf)
            for number, model in sorted(versions.items()):
                self._loaded[(name, number)] = _Loaded(model, 0)

    # -- the index -----------------------------------------------------------------------

    def _served_names(self, now: float, wanted: str | None = None) -> frozenset[str]:
        """The models served here: those named, else the repository's, listed again once
        per ``refresh_s``, or once ``miss_refresh_s`` has passed when ``wanted`` is not
        among them; concurrent requests share one listing."""
        if self.names is not None:
            return self.names
        if self.repository is None:
            return frozenset(self._indexes)
        listing = self._listing
        if listing is not None:
            age = now - listing.read_at
            missed = wanted is not None and wanted not in listing.names
            if age < self.refresh_s and not (missed and age >= self.miss_refresh_s):
                return listing.names
        repository = self.repository
        return self._reads.run(_LISTING, lambda: self._list(repository, listing, now)).names

    def _list(self, repository: ModelRepository, previous: _Listing | None, now: float) -> _Listing:
        """The repository listed now; when that fails, the last listing stands (for
        another ``refresh_s``, so a failing repository is not asked on every request)."""
        try:
            listing = _Listing(frozenset(repository.list_models()), now)
        except SpillwayError as error:
            if previous is None:
                raise
            log.warning("listing the repository failed, keeping the last listing: %s", error)
            listing = replace(previous, read_at=now)
        if previous is not None and listing.names - previous.names:
            log.info("models %s found in the repository", sorted(listing.names - previous.names))
        self._listing = listing
        return listing

    def index(self, name: str, *, missing: int | None = None) -> VersionIndex:
        """The model's index, read again when older than ``refresh_s`` (or than
        ``miss_refresh_s`` when it lacks the version ``missing``)."""
        now = self.clock()
        if name not in (served := self._served_names(now, name)):
            raise ModelNotFoundError.unknown(name, served)
        with self._lock:
            index = self._indexes.get(name)
            unserved = self._unserved.get(name)
        if index is not None:
            age = now - index.read_at
            stale = age >= self.refresh_s
            if missing is not None and missing not in index.versions:
                stale = stale or age >= self.miss_refresh_s
            if not stale or self.repository is None:
                return index
        repository = self.repository
        if repository is None:
            raise ModelNotFoundError.unknown(name, served)
        if index is None and unserved is not None and now - unserved[0] < self.miss_refresh_s:
            raise unserved[1]  # read less than miss_refresh_s ago: nothing was served
        return self._reads.run(name, lambda: self._read_index(repository, name, index, now))

    def _read_index(
        self, repository: ModelRepository, name: str, index: VersionIndex | None, now: float
    ) -> VersionIndex:
        try:
            config, versions = served_versions(repository, name)
        except ModelNotFoundError as error:
            if index is None:
                with self._lock:
                    self._unserved[name] = (now, error)
                raise
            log.warning("model %s: no version is served any more; keeping the last index", name)
            fresh = replace(index, read_at=now)
        else:
            fresh = VersionIndex(config, tuple(versions), now)
        with self._lock:
            self._indexes[name] = fresh
            self._unserved.pop(name, None)
        if index is not None and index.versions != fresh.versions:
            log.info("model %s: versions %s served (were %s)", name, fresh.versions, index.versions)
        return fresh

    def reread(self, name: str) -> bool:
        """Read a known model's index again now (a request that does not fit what it
        serves may be for a signature published since, or a rollback), unless the last
        read is less than ``miss_refresh_s`` old; whether it was read."""
        now = self.clock()
        with self._lock:
            index = self._indexes.get(name)
        repository = self.repository
        if repository is None or index is None or now - index.read_at < self.miss_refresh_s:
            return False
        self._reads.run(name, lambda: self._read_index(repository, name, index, now))
        return True

    def models(self) -> list[str]:
        """The models served here (pipelines left out), their indexes read."""
        names = sorted(self._served_names(self.clock()))
        return [n for n in names if not self.index(n).config.is_pipeline]

    # -- versions ------------------------------------------------------------------------

    def get(self, name: str, version: int | None) -> OnnxModel:
        """The version asked for (else the model's default one), loaded if need be; 404
        when the model's policy does not serve it."""
        index = self.index(name, missing=version)
        number = index.default() if version is None else version
        if number not in index.versions:
            raise ModelNotFoundError(f"model {name!r} has no version {number} loaded")
        key = (name, number)
        with self._lock:
            found = self._loaded.get(key)
            if found is not None:
                self._loaded.move_to_end(key)
                return found.model
            flight = self._flights.setdefault(key, threading.Lock())
        with flight:  # concurrent first requests share the one load
            with self._lock:
                found = self._loaded.get(key)
            if found is not None:
                return found.model
            return self._load_one(index.config, number)

    def _load_one(self, config: ModelConfig, number: int) -> OnnxModel:
        key = (config.name, number)
        if self.repository is None:
            raise ModelNotFoundError(f"model {config.name!r} has no version {number} loaded")
        with self._load_lock:  # one at a time: the budget is checked against settled loads
            started = time.monotonic()
            path = self.repository.fetch_version(config.name, number, self.cache_dir)
            footprint = file_footprint(path)
            self._make_room(footprint, key)
            model = self._open(config, number, path)
            with self._lock:
                self._loaded[key] = _Loaded(model, footprint)
                self._flights.pop(key, None)
                self.loads += 1
        log.info(
            "loaded %s v%d on demand in %.2f s (%.1f MB expected)",
            config.name,
            number,
            time.monotonic() - started,
            footprint / 1e6,
        )
        return model

    def _make_room(self, needed: int, loading: tuple[str, int]) -> None:
        budget = self.memory_budget_bytes
        if budget is None:
            return
        if needed > budget:
            raise InsufficientMemoryError(
                f"{loading[0]} v{loading[1]} needs {needed / 1e6:.1f} MB, over the "
                f"{budget / 1e6:.1f} MB memory budget"
            )
        with self._lock:
            while self._loaded and self.memory_in_use() + needed > budget:
                # Least recently used first; a request still holding an evicted model
                # finishes on it, and its memory goes with the last reference.
                (name, number), _ = self._loaded.popitem(last=False)
                self.evictions += 1
                log.info("evicted %s v%d to make room for %s v%d", name, number, *loading)

    def memory_in_use(self) -> int:
        """The expected footprints of the loaded versions."""
        return sum(entry.footprint for entry in self._loaded.values())

    def loaded(self) -> dict[str, dict[int, OnnxModel]]:
        """The versions loaded now, by model and version."""
        with self._lock:
            items = list(self._loaded.items())
        found: dict[str, dict[int, OnnxModel]] = {}
        for (name, number), entry in sorted(items, key=lambda item: item[0]):
            found.setdefault(name, {})[number] = entry.model
        return found

    def preload(self) -> None:
        """Load every version each model's policy serves now (at start-up, so a
        provisioned instance answers its first request without a load)."""
        for name in self.models():
            for number in self.index(name).versions:
                self.get(name, number)
