"""Versions as a contract between the router and its backends, and the canary record
followed in every mode: fake backends (one serves the canary, one does not), an
in-memory state table and a fake clock."""

from __future__ import annotations

import io
import json
import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, cast

import pytest
from werkzeug.test import Client

from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.canary.records import CanaryStore
from spillway.policy.backend import Backend, BackendRequest
from spillway.router.batch_mode import BatchBackend, BatchReceipt
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from tests.memory_store import MemoryStateStore
from tests.unit.canary_support import BODY, PATH, VERSION, Clock, VersionedBackend
from tests.unit.router_support import fake_overrides

SERVERLESS = {"x-spillway-mode": "serverless"}


@dataclass
class Recorded:
    """What a fake async store or jobs API was handed."""

    versions: list[str | None] = field(default_factory=list)


class RecordingSubmitter:
    """A jobs API that accepts every job and notes the version it was asked for."""

    def __init__(self) -> None:
        self.seen = Recorded()

    def submit(self, request: BackendRequest, timeout_s: float) -> BatchReceipt:
        self.seen.versions.append(request.version)
        return BatchReceipt(f"job-{len(self.seen.versions)}")


@dataclass
class _Record:
    id: str
    state: str = "queued"


class RecordingAsyncStore:
    """An async store that queues nothing and notes the version of each request."""

    def __init__(self) -> None:
        self.seen = Recorded()
        self.settings = AsyncSettings()

    def submit(self, *, version: str | None, **_: Any) -> tuple[_Record, bool]:
        self.seen.versions.append(version)
        return _Record(f"r{len(self.seen.versions)}"), False

    def areas(self, tenant: str | None) -> list[str]:
        return []


@dataclass
class Stack:
    """A router over a GPU and a CPU backend, and what it wrote."""

    client: Client
    metrics: io.StringIO
    gpu: VersionedBackend
    cpu: VersionedBackend
    canaries: CanaryStore
    clock: Clock

    def post(self, headers: dict[str, str] | None = None, path: str = PATH) -> Any:
        return self.client.post(path, data=BODY, headers=headers or {})

    def count(self, metric: str) -> int:
        return sum(metric in line for line in self.metrics.getvalue().splitlines())


def stack(
    *,
    gpu_missing: set[int] | None = None,
    cpu_missing: set[int] | None = None,
    submitter: RecordingSubmitter | None = None,
    async_store: RecordingAsyncStore | None = None,
) -> Stack:
    store, clock = MemoryStateStore(), Clock()
    gpu = VersionedBackend(clock, missing=gpu_missing or set(), name="gpu")
    cpu = VersionedBackend(clock, missing=cpu_missing or set(), name="cpu")
    metrics = io.StringIO()
    backends: dict[str, Backend] = {"gpu": gpu, "cpu": cpu, "batch": BatchBackend(submitter)}
    overrides = replace(
        fake_overrides(backends, clock, metrics, state=store),
        async_store=cast(AsyncStore, async_store),
    )
    app = create_app(RouterSettings(canary_seed=5), overrides)
    return Stack(Client(app), metrics, gpu, cpu, CanaryStore(store, clock), clock)


def test_a_canary_the_gpu_service_lacks_is_served_by_the_cpu_fallback_not_a_404() -> None:
    # GIVEN digits v2 as a 50 % canary that the CPU fallback serves and the GPU service
    # does not (404 model_not_found for v2)
    s = stack(gpu_missing={2})
    s.canaries.start("digits", 2, 50, stable=1)
    # WHEN 40 requests arrive (the GPU service first, the CPU fallback after it)
    answers = [s.post() for _ in range(40)]
    # THEN none is a 404; the canary's share was answered with v2 by the CPU fallback
    statuses = Counter(f"v{a.headers[VERSION]}:{a.status_code}" for a in answers)
    assert set(statuses) == {"v1:200", "v2:200"}, statuses
    canary = [a for a in answers if a.headers[VERSION] == "2"]
    assert {a.headers["x-spillway-backend"] for a in canary} == {"cpu"}
    assert {a.headers["x-spillway-fallback"] for a in canary} == {"gpu:version_not_served"}
    # AND the GPU service was sent v2 once: the router remembers what it does not serve
    gpu_versions = Counter(r.version for r in s.gpu.requests if r.operation == "infer")
    assert gpu_versions["2"] == 1
    assert gpu_versions["1"] == statuses["v1:200"]


def test_a_canary_no_backend_serves_goes_to_the_stable_version_and_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # GIVEN a 50 % canary v2 that neither backend serves
    caplog.set_level(logging.WARNING, logger="spillway.router.canary")
    s = stack(gpu_missing={2}, cpu_missing={2})
    s.canaries.start("digits", 2, 50, stable=1)
    # WHEN 40 requests arrive (20 by default, 20 in serverless mode)
    answers = [s.post(SERVERLESS if i % 2 else None) for i in range(40)]
    # THEN all 40 are served by the stable version, none a 404
    assert Counter(f"v{a.headers[VERSION]}:{a.status_code}" for a in answers) == Counter(
        {"v1:200": 40}
    )
    # AND each request whose draw chose the canary was counted, the log said so once (in
    # one cache period), and the canary still runs
    assert s.count("CanaryVersionUnserved") > 0
    said = [r.getMessage() for r in caplog.records if "no backend serves" in r.getMessage()]
    assert len(said) == 1
    state = s.canaries.load("digits")
    assert state is not None
    assert state.status == "running"


def test_a_gpu_outage_during_a_canary_gives_no_404() -> None:
    # GIVEN a 50 % canary v2 the CPU fallback lacks, and a GPU service that is down
    s = stack(cpu_missing={2})
    s.canaries.start("digits", 2, 50, stable=1)
    s.gpu.missing.clear()

    def down(request: BackendRequest, timeout_s: float) -> Any:
        from spillway.policy.backend import ConnectFailed

        raise ConnectFailed("gpu: connection refused")

    s.gpu.send = down  # type: ignore[method-assign]
    # WHEN 40 requests arrive
    answers = [s.post() for _ in range(40)]
    # THEN every one is answered 200 by the CPU fallback on the stable version
    assert Counter(a.status_code for a in answers) == Counter({200: 40})
    assert {a.headers[VERSION] for a in answers} == {"1"}
    assert {a.headers["x-spillway-backend"] for a in answers} == {"cpu"}


def test_a_client_that_pins_a_missing_version_still_gets_its_404() -> None:
    # GIVEN a canary record, and a version (7) no backend serves
    s = stack(gpu_missing={7}, cpu_missing={7})
    s.canaries.start("digits", 2, 50, stable=1)
    # WHEN a client pins version 7
    answer = s.post(path="/v2/models/digits/versions/7/infer")
    # THEN the 404 is the client's answer: it asked for that version
    assert answer.status_code == 404
    assert json.loads(answer.data)["code"] == "model_not_found"


def test_unpinned_async_requests_follow_the_canary_record() -> None:
    # GIVEN a 50 % canary v2 over stable v1, and async mode
    recorder = RecordingAsyncStore()
    s = stack(async_store=recorder)
    s.canaries.start("digits", 2, 50, stable=1)
    # WHEN 40 unpinned async requests are accepted
    accepted = [s.post({"x-spillway-mode": "async"}).status_code for _ in range(40)]
    # THEN each was queued with a version chosen from the record (both versions drawn)
    assert accepted == [202] * 40
    assert set(recorder.seen.versions) == {"1", "2"}
    # WHEN the canary is rolled back and the routers have read the record again
    s.canaries.rollback("digits", 2, "operator")
    s.clock.advance(6)
    before = len(recorder.seen.versions)
    for _ in range(40):
        s.post({"x-spillway-mode": "async"})
    # THEN every unpinned async request is queued for the stable version, never v2 (nor
    # without a version, which a worker would serve with its newest: the rolled-back one)
    assert recorder.seen.versions[before:] == ["1"] * 40


def test_unpinned_batch_mode_requests_follow_the_canary_record() -> None:
    # GIVEN a 50 % canary v2 over stable v1, and batch mode
    submitter = RecordingSubmitter()
    s = stack(submitter=submitter)
    s.canaries.start("digits", 2, 50, stable=1)
    # WHEN 40 unpinned batch-mode requests are submitted
    statuses = [s.post({"x-spillway-mode": "batch"}).status_code for _ in range(40)]
    assert statuses == [202] * 40
    assert set(submitter.seen.versions) == {"1", "2"}
    # WHEN the canary is rolled back
    s.canaries.rollback("digits", 2, "operator")
    s.clock.advance(6)
    before = len(submitter.seen.versions)
    for _ in range(40):
        s.post({"x-spillway-mode": "batch"})
    # THEN every job is submitted for the stable version
    assert submitter.seen.versions[before:] == ["1"] * 40
