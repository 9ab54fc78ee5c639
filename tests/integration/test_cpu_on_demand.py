"""The CPU fallback serves models and versions published after it started: its repository
index is read again (for a name or version the last read lacked, at once, at most once
per miss window, concurrent requests sharing one read), and a served version is loaded
on demand, once however many requests wait for it, verified against its checksums,
within a memory budget. Real ONNX Runtime on the digits model in a local repository."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from spillway.fallback.direct import handle_direct
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.config import CHECKSUM_FILE, ModelConfig
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.loader import OnDemandVersions, file_footprint, open_version
from spillway.models.repository import LocalRepository
from spillway.protocol.errors import (
    ChecksumMismatchError,
    InsufficientMemoryError,
    ModelNotFoundError,
)
from tests.fakes import eventually
from tests.support import link_model

IMAGE = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def repo(models_dir: Path, tmp_path: Path) -> LocalRepository:
    """digits v1 alone (its default policy serves the newest version)."""
    root = tmp_path / "repo"
    root.mkdir()
    link_model(models_dir, root, "digits")
    return LocalRepository(root)


def publish(repo: LocalRepository, *, serve: list[int] | None) -> int:
    """A copy of v1 as the next version; ``serve``: the policy's list (``None``: as is)."""
    folder = repo.root / "digits" / "1"
    files = {p.name: p for p in folder.iterdir() if p.name != CHECKSUM_FILE}
    config = repo.read_config("digits")
    if serve is not None:
        document = config.model_dump(mode="json")
        document["version_policy"] = {"specific": {"versions": serve}}
        config = ModelConfig.model_validate(document)
    # Written by an atomic rename: the hard-linked built model is never written through.
    return repo.publish_version("digits", files, config)


def test_a_version_published_after_start_is_served_by_the_cpu_fallback(
    repo: LocalRepository, tmp_path: Path
) -> None:
    # GIVEN a CPU fallback started while digits had v1 only
    settings = CpuSettings(
        repository=repo.location, models=["digits"], cache_dir=tmp_path, index_miss_refresh_s=0
    )
    service = CpuService.load(settings, repo)
    assert sorted(service.models["digits"]) == [1]
    # WHEN v2 is published with a policy that serves v1 and v2, and a request names v2
    assert publish(repo, serve=[1, 2]) == 2
    event = {"model": "digits", "version": "2", "body": {"inputs": [IMAGE]}}
    answer = handle_direct(service, event)
    # THEN v2 answers (loaded on demand), and an unpinned request gets the newest version
    # the policy serves, as on the GPU service
    assert answer["statusCode"] == 200, answer["body"]
    assert answer["headers"]["x-spillway-model-version"] == "2"
    assert sorted(service.models["digits"]) == [1, 2]
    default = handle_direct(service, {"model": "digits", "body": {"inputs": [IMAGE]}})
    assert default["headers"]["x-spillway-model-version"] == "2"
    # AND its metadata lists both served versions
    assert service.metadata("digits", None)["versions"] == ["1", "2"]


def counting_opener(calls: list[int], gate: threading.Event | None = None) -> object:
    def opener(config: ModelConfig, number: int, path: Path) -> OnnxModel:
        calls.append(number)
        if gate is not None:
            gate.wait(30)
        return open_version(config, number, path, EngineOptions())

    return opener


def on_demand(
    repo: LocalRepository,
    tmp_path: Path,
    names: tuple[str, ...] | None = ("digits",),
    **options: object,
) -> OnDemandVersions:
    """The versions of ``names`` (``None``: every model of the repository)."""
    return OnDemandVersions(
        repo,
        names,
        cache_dir=tmp_path / "cache",
        options=EngineOptions(),
        **options,  # type: ignore[arg-type]
    )


def test_concurrent_first_requests_share_one_load(repo: LocalRepository, tmp_path: Path) -> None:
    # GIVEN v2 published, not loaded, and a load that waits until every request is in
    assert publish(repo, serve=[1, 2]) == 2
    calls: list[int] = []
    gate = threading.Event()
    versions = on_demand(repo, tmp_path, opener=counting_opener(calls, gate))
    results: list[OnnxModel] = []
    start = threading.Barrier(9)

    def ask() -> None:
        start.wait(30)
        results.append(versions.get("digits", 2))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    # WHEN 8 requests ask for v2 at once
    start.wait(30)
    gate.set()
    for thread in threads:
        thread.join(30)
    # THEN it was loaded once and all 8 got that one session
    assert calls == [2]
    assert len(results) == 8
    assert len({id(model) for model in results}) == 1


def test_a_version_whose_file_does_not_match_its_checksum_is_refused(
    repo: LocalRepository, tmp_path: Path
) -> None:
    # GIVEN v2 published, then its model file altered
    assert publish(repo, serve=[1, 2]) == 2
    onnx_file = repo.root / "digits" / "2" / "model.onnx"
    onnx_file.write_bytes(onnx_file.read_bytes() + b"\0")
    calls: list[int] = []
    versions = on_demand(repo, tmp_path, opener=counting_opener(calls))
    # WHEN a request asks for v2
    # THEN the load fails on the checksum, nothing was opened, and v1 still serves
    with pytest.raises(ChecksumMismatchError):
        versions.get("digits", 2)
    assert calls == []
    assert versions.get("digits", 1).version == 1


def test_loads_stay_within_the_memory_budget(repo: LocalRepository, tmp_path: Path) -> None:
    # GIVEN v1 and v2 served, and a budget that holds one of them
    assert publish(repo, serve=[1, 2]) == 2
    one = file_footprint(repo.root / "digits" / "1")
    versions = on_demand(repo, tmp_path, memory_budget_bytes=one + one // 2)
    versions.get("digits", 1)
    # WHEN v2 is asked for
    versions.get("digits", 2)
    # THEN v1 (least recently used) was evicted to make room
    assert {n: sorted(v) for n, v in versions.loaded().items()} == {"digits": [2]}
    assert versions.evictions == 1
    assert versions.memory_in_use() <= one + one // 2
    # AND a budget smaller than one version refuses the load (503 insufficient_memory)
    tiny = on_demand(repo, tmp_path, memory_budget_bytes=one // 2)
    with pytest.raises(InsufficientMemoryError) as refused:
        tiny.get("digits", 1)
    assert refused.value.status == 503


def test_the_index_is_read_again_when_a_version_is_missing_and_when_it_is_old(
    repo: LocalRepository, tmp_path: Path
) -> None:
    # GIVEN an index read at start (v1), re-read at most every 5 s for a missing version
    clock = Clock()
    versions = on_demand(repo, tmp_path, refresh_s=60.0, miss_refresh_s=5.0, clock=clock)
    assert versions.index("digits").versions == (1,)
    assert publish(repo, serve=[1, 2]) == 2
    # WHEN v2 is asked for within 5 s of the last read
    # THEN it is not known yet (the repository is not read on every miss)
    with pytest.raises(ModelNotFoundError):
        versions.get("digits", 2)
    # WHEN 5 s have passed
    clock.now += 5
    # THEN v2 is found and served
    assert versions.get("digits", 2).version == 2
    # WHEN a v3 is published with a policy serving only it, and 60 s pass
    assert publish(repo, serve=[3]) == 3
    clock.now += 60
    # THEN an unpinned request gets v3, and v1 is no longer served
    assert versions.get("digits", None).version == 3
    with pytest.raises(ModelNotFoundError):
        versions.get("digits", 1)


class TallyClock(Clock):
    """A clock that counts its reads: each look-up of a name reads it once, first."""

    reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class WatchedRepository(LocalRepository):
    """A local repository that counts its listings and each model's version reads (what
    reading a model's index costs, besides its configuration); with ``hold``, either
    answers only once ``hold`` holds."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.listings = 0
        self.reads: dict[str, int] = {}
        self.hold: Callable[[], bool] | None = None

    def list_models(self) -> list[str]:
        self.listings += 1
        self._wait()
        return super().list_models()

    def list_versions(self, model: str) -> list[int]:
        self.reads[model] = self.reads.get(model, 0) + 1
        self._wait()
        return super().list_versions(model)

    def _wait(self) -> None:
        if self.hold is not None:
            eventually(self.hold, "every request asked", timeout_s=30)


def publish_model(repo: LocalRepository, name: str) -> None:
    """A new model ``name``: digits' configuration and files under another name."""
    folder = repo.root / "digits" / "1"
    files = {p.name: p for p in folder.iterdir() if p.name != CHECKSUM_FILE}
    document = repo.read_config("digits").model_dump(mode="json")
    repo.publish_version(name, files, ModelConfig.model_validate({**document, "name": name}))


def serving_all(repo: LocalRepository, tmp_path: Path, clock: Clock) -> CpuService:
    """A CPU fallback serving every model of ``repo`` (the default), started now."""
    settings = CpuSettings(repository=repo.location, cache_dir=tmp_path / "cache")
    versions = OnDemandVersions(
        repo, None, cache_dir=settings.cache_dir, options=settings.engine_options(), clock=clock
    )
    versions.preload()
    return CpuService(versions, settings)


def test_a_model_published_after_start_is_served_by_its_first_request(
    repo: LocalRepository, tmp_path: Path
) -> None:
    # GIVEN a CPU fallback serving its whole repository, started while it held digits only
    clock = Clock()
    service = serving_all(repo, tmp_path, clock)
    assert sorted(service.models) == ["digits"]
    # WHEN, a few seconds later (what `spillway models add` takes), a model is published
    # and its first request arrives
    clock.now += 3
    publish_model(repo, "scribe")
    answer = handle_direct(service, {"model": "scribe", "body": {"inputs": [IMAGE]}})
    # THEN that request is served (no 404 until the next periodic read, 60 s away)
    assert answer["statusCode"] == 200, answer["body"]
    assert answer["headers"]["x-spillway-model-version"] == "1"
    assert sorted(service.models) == ["digits", "scribe"]


def ask_at_once(count: int, ask: Callable[[], object]) -> list[object]:
    """``count`` threads calling ``ask`` together; what each got (an error as itself)."""
    results: list[object] = []

    def one() -> None:
        try:
            results.append(ask())
        except ModelNotFoundError as error:
            results.append(error)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_concurrent_misses_share_one_lookup(repo: LocalRepository, tmp_path: Path) -> None:
    # GIVEN a fallback serving its whole repository over a repository that counts reads,
    # and later a new model and a new digits version published
    clock = TallyClock()
    watched = WatchedRepository(repo.root)
    versions = on_demand(watched, tmp_path, names=None, clock=clock)
    versions.preload()
    clock.now += 3
    publish_model(repo, "scribe")
    assert publish(repo, serve=[1, 2]) == 2
    listings, reads = watched.listings, dict(watched.reads)
    # WHEN 8 requests name the new model at once (the listing answers once all have asked)
    asked = clock.reads
    watched.hold = lambda: clock.reads >= asked + 8
    models = ask_at_once(8, lambda: versions.get("scribe", None))
    # THEN one listing and one read of its versions served them all
    assert {getattr(m, "name", m) for m in models} == {"scribe"}
    assert watched.listings == listings + 1
    assert watched.reads.get("scribe") == 1
    # AND 8 requests for the new digits version at once read digits' versions once
    clock.now += 3
    asked = clock.reads
    watched.hold = lambda: clock.reads >= asked + 8
    pinned = ask_at_once(8, lambda: versions.get("digits", 2))
    assert {getattr(m, "version", m) for m in pinned} == {2}
    assert watched.reads["digits"] == reads["digits"] + 1
    assert watched.listings == listings + 1


def test_names_that_do_not_exist_cost_one_listing_per_miss_window(
    repo: LocalRepository, tmp_path: Path
) -> None:
    # GIVEN a fallback serving every model of its repository (listed at start), its
    # misses read again at most once per second
    clock = Clock()
    watched = WatchedRepository(repo.root)
    versions = on_demand(watched, tmp_path, names=None, clock=clock, miss_refresh_s=1.0)
    assert versions.models() == ["digits"]
    listings = watched.listings
    # WHEN 50 requests name models that do not exist within that second
    for i in range(50):
        with pytest.raises(ModelNotFoundError):
            versions.get(f"invented-{i}", None)
    # THEN the repository was not read for them
    assert watched.listings == listings
    # WHEN a second later 50 more do
    clock.now += 1
    for i in range(50, 100):
        with pytest.raises(ModelNotFoundError):
            versions.get(f"invented-{i}", None)
    # THEN one listing answered for all 50 (whatever the names, whoever asks)
    assert watched.listings == listings + 1
    # AND a listed model that serves no version yet is read once per second, not per request
    empty = repo.root / "empty"
    empty.mkdir()
    document = repo.read_config("digits").model_dump(mode="json")
    (empty / "config.json").write_text(json.dumps({**document, "name": "empty"}))
    clock.now += 1
    for _ in range(20):
        with pytest.raises(ModelNotFoundError, match="no version its version_policy serves"):
            versions.get("empty", None)
    assert watched.reads["empty"] == 1
    clock.now += 1
    with pytest.raises(ModelNotFoundError):
        versions.get("empty", None)
    assert watched.reads["empty"] == 2
