"""Faults with real processes on 127.0.0.1: a killed, frozen or full GPU service.

The GPU service runs as its own process (``python -m gpu_service``); the CPU fallback
and the router run as threaded HTTP servers in this process; clients speak HTTP to the
router. The router's clock is the real one plus an offset the tests move, so circuit
waits pass without sleeping.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillway.fallback.app import CpuApp
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.repository import LocalRepository
from spillway.router.app import RouterApp
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app
from spillway_cli.local import procs
from spillway_cli.local.wsgi_server import running
from tests.fakes import eventually
from tests.support import Service, gpu_service, link_model, write_slow_model


class OffsetClock:
    """``time.monotonic`` plus an offset the test can move forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]


def post(url: str, body: dict[str, Any], **headers: str) -> Reply:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return Reply(
                response.status,
                {k.lower(): v for k, v in response.headers.items()},
                json.loads(response.read()),
            )
    except urllib.error.HTTPError as error:
        return Reply(
            error.code,
            {k.lower(): v for k, v in error.headers.items()},
            json.loads(error.read() or b"{}"),
        )


@pytest.fixture(scope="module")
def images(models_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Sample images and the labels the model itself gives them (not the true digits)."""
    pictures = np.load(models_dir / "digits" / "samples" / "images.npy")[:64].astype(np.float32)
    local = LocalRepository(models_dir)
    model = OnnxModel(
        "digits",
        1,
        local.read_config("digits"),
        local.fetch_version("digits", 1, models_dir),
        EngineOptions(),
    )
    return pictures, model.infer({"image": pictures})["label"][:, 0]


@pytest.fixture(scope="module")
def gpu_repo(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpu-repo")
    link_model(models_dir, root, "digits")
    # One request computing, one waiting: the third concurrent one gets 429.
    write_slow_model(root, "slowq", max_batch_size=1, max_queue_size=1, steps=3)
    return root


@pytest.fixture(scope="module")
def cpu_url(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("cpu-repo")
    link_model(models_dir, root, "digits")
    write_slow_model(root, "slowq", max_batch_size=1, max_queue_size=1, steps=0)
    cpu = CpuService.load(CpuSettings(repository=str(root)))
    with running(CpuApp(cpu)) as url:
        yield url


@pytest.fixture(scope="module")
def gpu(gpu_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A GPU service with one instance per model: a second request waits in the queue."""
    with gpu_service(gpu_repo, tmp_path_factory.mktemp("gpu-logs"), instance_count="1") as svc:
        yield svc


def router_for(gpu: Service, cpu_url: str, clock: OffsetClock, **settings: Any) -> RouterApp:
    options = {
        "gpu_url": gpu.base,
        "cpu_url": cpu_url,
        "metrics_log": Path("/dev/null"),
        **settings,
    }
    return create_app(RouterSettings(**options), Overrides(clock=clock))


def digit(images: tuple[np.ndarray, np.ndarray], i: int) -> dict[str, Any]:
    data = images[0][i % len(images[0])].ravel().tolist()
    return {
        "inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": data}],
        "outputs": [{"name": "label"}],
    }


def label_of(reply: Reply) -> int:
    return int(reply.body["outputs"][0]["data"][0])


def test_gpu_killed_under_load_fails_no_client_request(
    gpu_repo: Path, cpu_url: str, images: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    # GIVEN a GPU service, the CPU fallback and the router, and 4 clients sending 60 each
    clock = OffsetClock()
    with gpu_service(gpu_repo, tmp_path) as gpu, running(router_for(gpu, cpu_url, clock)) as url:
        infer = f"{url}/v2/models/digits/infer"
        done = threading.Semaphore(0)
        killed = threading.Event()

        def client(worker: int) -> list[tuple[int, Reply, bool]]:
            results = []
            for n in range(60):
                i = worker * 60 + n
                sent_after_kill = killed.is_set()
                results.append((i, post(infer, digit(images, i)), sent_after_kill))
                done.release()
            return results

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(client, w) for w in range(4)]
            for _ in range(80):  # WHEN the GPU is SIGKILLed after 80 answers, mid-load
                done.acquire()
            gpu.child.signal(signal.SIGKILL)
            killed.set()
            results = [r for f in futures for r in f.result()]
    # THEN every request succeeded with its own right answer
    assert len(results) == 240
    assert [r.status for _, r, _ in results] == [200] * 240
    assert all(label_of(r) == int(images[1][i % len(images[1])]) for i, r, _ in results)
    # AND the ones sent after the kill were served by the fallback and say so
    after = [r for _, r, was_killed in results if was_killed]
    assert len(after) >= 100
    assert {r.headers["x-spillway-backend"] for r in after} == {"cpu"}
    reasons = {r.headers["x-spillway-fallback"] for r in after}
    assert reasons <= {"gpu:connect_error", "gpu:connection_lost", "gpu:circuit_open"}
    assert "gpu:circuit_open" in reasons
    before = [r for _, r, was_killed in results if not was_killed]
    assert sum(r.headers["x-spillway-backend"] == "gpu" for r in before) >= 70


def test_circuit_opens_half_opens_and_closes_against_a_frozen_gpu(
    gpu: Service, cpu_url: str, images: tuple[np.ndarray, np.ndarray]
) -> None:
    clock = OffsetClock()
    app = router_for(gpu, cpu_url, clock, breaker_reset_s=5, breaker_max_reset_s=60)
    breaker = app.router.breakers["gpu"]
    with running(app) as url:
        infer = f"{url}/v2/models/digits/infer"
        budget = {"x-spillway-latency-budget-ms": "400"}

        def backend_and_reason() -> tuple[str, str | None]:
            reply = post(infer, digit(images, 0), **budget)
            assert reply.status == 200
            assert label_of(reply) == int(images[1][0])
            return reply.headers["x-spillway-backend"], reply.headers.get("x-spillway-fallback")

        assert backend_and_reason() == ("gpu", None)
        # GIVEN a GPU service that stops answering (SIGSTOP: connections hang)
        gpu.child.signal(signal.SIGSTOP)
        try:
            # WHEN five requests time out on it, each is served by the fallback
            assert [backend_and_reason() for _ in range(5)] == [("cpu", "gpu:timeout")] * 5
            # THEN the circuit is open: the GPU is not even tried
            assert str(breaker.state) == "open"
            assert backend_and_reason() == ("cpu", "gpu:circuit_open")
            # WHEN the 5 s wait passes, one trial goes to the still frozen GPU and fails
            clock.offset += 5
            assert str(breaker.state) == "half_open"
            assert backend_and_reason() == ("cpu", "gpu:timeout")
            # THEN the circuit re-opens for twice as long
            assert str(breaker.state) == "open"
            assert breaker.reset_s == 10
            clock.offset += 5
            assert backend_and_reason() == ("cpu", "gpu:circuit_open")
        finally:
            gpu.child.signal(signal.SIGCONT)
        # WHEN the GPU is back and the longer wait has passed, the trial succeeds
        clock.offset += 5
        assert backend_and_reason() == ("gpu", None)
        # THEN the circuit is closed and the GPU serves again
        assert str(breaker.state) == "closed"
        assert breaker.reset_s == 5
        assert backend_and_reason() == ("gpu", None)
        assert breaker.opened_count == 2


def test_a_full_gpu_queue_429_falls_back_to_the_cpu(gpu: Service, cpu_url: str) -> None:
    # GIVEN a GPU model that holds one request computing and one waiting
    clock = OffsetClock()
    with running(router_for(gpu, cpu_url, clock)) as url:
        body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [7.0]}]}
        # WHEN eight requests arrive at once
        with ThreadPoolExecutor(8) as pool:
            # A generous budget: only a full queue, not a slow one, sends work elsewhere.
            budget = {"x-spillway-latency-budget-ms": "30000"}
            replies = list(
                pool.map(lambda _: post(f"{url}/v2/models/slowq/infer", body, **budget), range(8))
            )
    # THEN none fails: the GPU served what its queue held, the CPU the rest
    assert [r.status for r in replies] == [200] * 8
    assert all(r.body["outputs"][0]["data"] == [7.0] for r in replies)
    fallbacks = [r for r in replies if r.headers["x-spillway-backend"] == "cpu"]
    assert len(fallbacks) >= 1
    assert {r.headers["x-spillway-fallback"] for r in fallbacks} == {"gpu:overloaded"}
    assert sum(r.headers["x-spillway-backend"] == "gpu" for r in replies) >= 2


def _pending(gpu: Service, model: str) -> float:
    """The GPU service's count of requests queued or computing for ``model``."""
    with urllib.request.urlopen(f"{gpu.base}/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("nv_inference_pending_request_count") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _slowq_stats(gpu: Service) -> dict[str, Any]:
    with urllib.request.urlopen(f"{gpu.base}/v2/models/slowq/stats", timeout=10) as response:
        stats: dict[str, Any] = json.loads(response.read())["model_stats"][0]
        return stats


def test_the_deadline_is_carried_to_the_gpu_and_respected(gpu: Service) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
    direct = f"{gpu.base}/v2/models/slowq/infer"
    assert post(direct, body).status == 200  # loaded and warm
    before = _slowq_stats(gpu)
    app = create_app(RouterSettings(gpu_url=gpu.base, metrics_log=Path("/dev/null")))
    finished: list[str] = []
    with running(app) as url, ThreadPoolExecutor(1) as pool:
        # GIVEN the GPU's only instance busy computing a slow request

        def block() -> Reply:
            reply = post(direct, body)
            finished.append("blocker")
            return reply

        blocker = pool.submit(block)
        eventually(lambda: _pending(gpu, "slowq") >= 1, "the blocker is queued or running")
        # WHEN a request with a 150 ms budget is routed to the same model
        budget = {"x-spillway-latency-budget-ms": "150"}
        routed = post(f"{url}/v2/models/slowq/infer", body, **budget)
        finished.append("routed")
        assert blocker.result().status == 200
    # THEN it is refused before the slow request is done: the GPU, told the deadline,
    # expects the queue ahead (and the request's own run) to outlast it and sheds it at
    # once with a retry hint, which the router relays, having no other backend
    assert routed.status == 429
    assert routed.body["code"] == "deadline_unmeetable"
    assert float(routed.headers["retry-after"]) >= 1
    assert finished == ["routed", "blocker"]
    # AND it was never queued, let alone computed: only the blocker ran
    after = _slowq_stats(gpu)
    assert after["execution_count"] == before["execution_count"] + 1
    assert after["spillway"]["rejected"] == before["spillway"]["rejected"] + 1
    assert after["spillway"]["expired"] == before["spillway"]["expired"]


def test_a_gpu_service_started_late_serves_within_seconds_of_being_ready(
    gpu_repo: Path, cpu_url: str, images: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    # GIVEN a router whose GPU service is not running yet (its port refuses connections),
    # with a 60 s circuit wait: only a readiness probe can close the circuit sooner
    port = procs.free_port()
    app = create_app(
        RouterSettings(
            gpu_url=f"http://127.0.0.1:{port}", cpu_url=cpu_url, metrics_log=Path("/dev/null"),
            breaker_reset_s=60, breaker_max_reset_s=120, breaker_probe_interval_s=0.5,
        ),
        Overrides(clock=time.monotonic),
    )  # fmt: skip
    breaker = app.router.breakers["gpu"]
    served: list[tuple[float, str]] = []
    stop = threading.Event()
    with running(app) as url:
        infer = f"{url}/v2/models/digits/infer"

        def client() -> None:
            i = 0
            while not stop.is_set():
                reply = post(infer, digit(images, i))
                assert reply.status == 200
                assert label_of(reply) == int(images[1][i % len(images[1])])
                served.append((time.monotonic(), reply.headers["x-spillway-backend"]))
                i += 1

        with ThreadPoolExecutor(1) as pool:
            load = pool.submit(client)
            try:
                # WHEN the refusals have opened the circuit and the CPU serves everything
                eventually(lambda: str(breaker.state) == "open", "the GPU circuit opened")
                eventually(lambda: len(served) >= 20, "20 requests served while it starts")
                # AND the GPU service starts on that port, seconds later
                with gpu_service(gpu_repo, tmp_path, port=port):
                    ready = time.monotonic()
                    # THEN the GPU serves the router's requests within seconds of being ready
                    eventually(
                        lambda: sum(b == "gpu" and t > ready for t, b in served) >= 20,
                        "20 requests served by the GPU after it became ready",
                        timeout_s=30,
                    )
                    stop.set()
                    load.result()  # before the service stops
                    closed, opened = str(breaker.state), breaker.opened_count
            finally:
                stop.set()
    first_gpu = next(t for t, b in served if b == "gpu")
    assert {b for _, b in served[:20]} == {"cpu"}
    assert (closed, opened) == ("closed", 1)
    assert first_gpu - ready < 5.0
    # AND few requests went to the CPU once the GPU was ready (a probe interval's worth,
    # not the circuit's 60 s: without the probe, 2,399 in 15 s and none on the GPU)
    late_cpu = sum(b == "cpu" and t > ready for t, b in served)
    assert late_cpu < 200
