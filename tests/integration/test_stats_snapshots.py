"""Statistics are one snapshot: what Triton's perf_analyzer checks, under concurrent load.

perf_analyzer reads ``/v2/models/stats`` before and after each measurement window and
aborts with "Server side statistics compute counts must be the same" unless, for the
model and for each composing model of a pipeline, the windows' differences of
``compute_input``, ``compute_infer`` and ``compute_output`` counts are equal. That holds
for any two snapshots only if every snapshot has them equal, so this test takes many
snapshots while requests are in flight and checks each one: per model version,
success == queue == compute_input == compute_infer == compute_output (counts).

The load mixes small requests (decoded and encoded on the event loop), bigger ones
(over ``GPU_INLINE_PARSE_BYTES``: decoded and encoded on the parse threads, so a batch's
end and its answers lie several loop turns apart) and ``topics`` pipeline requests (its
step models ``minilm`` and ``topics-head`` are the composing models perf_analyzer reads).
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import Service, gpu_service, link_model

LOAD_S = 2.5
"""How long the load runs; snapshots are taken back to back meanwhile."""
PER_REQUEST = ("success", "queue", "compute_input", "compute_infer", "compute_output")
INLINE_PARSE_BYTES = 2048
"""A one-image request (about 500 bytes of JSON) stays on the loop; eight images go to
the parse threads."""


@pytest.fixture(scope="module")
def stats_service(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("stats-repo")
    for name in ("digits", "minilm", "topics-head", "topics"):
        link_model(models_dir, root, name)
    logs = tmp_path_factory.mktemp("stats-logs")
    with gpu_service(root, logs, inline_parse_bytes=str(INLINE_PARSE_BYTES)) as service:
        yield service


def _digits_body(images: np.ndarray) -> bytes:
    tensor = {
        "name": "image",
        "shape": list(images.shape),
        "datatype": "FP32",
        "data": images.flatten().tolist(),
    }
    return json.dumps({"inputs": [tensor]}).encode()


def _topics_body(text: str) -> bytes:
    tensor = {"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}
    return json.dumps({"inputs": [tensor]}).encode()


def _load(service: Service, path: str, bodies: Callable[[], bytes], stop: threading.Event) -> int:
    """Send requests one after another on one connection until ``stop``; the count of
    200 answers."""
    served = 0
    connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)
    try:
        while not stop.is_set():
            connection.request("POST", path, bodies(), {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            assert response.status == 200, response.status
            served += 1
    finally:
        connection.close()
    return served


def _snapshot(connection: http.client.HTTPConnection) -> dict[str, dict[str, Any]]:
    """Every model version's statistics from one ``GET /v2/models/stats``."""
    connection.request("GET", "/v2/models/stats")
    response = connection.getresponse()
    body = response.read()
    assert response.status == 200
    return {e["name"]: e for e in json.loads(body)["model_stats"]}


def _metrics(connection: http.client.HTTPConnection) -> dict[str, float]:
    """``GET /metrics`` as series name (with labels) -> value."""
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    text = response.read().decode()
    assert response.status == 200
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#")]
    return {series: float(value) for series, value in lines}


def _counts(entry: dict[str, Any]) -> dict[str, int | None]:
    stats = entry["inference_stats"]
    return {kind: stats.get(kind, {}).get("count") for kind in PER_REQUEST}


def _grown(before: dict[str, Any], after: dict[str, Any], kind: str) -> int:
    count: int = after["inference_stats"][kind]["count"] - before["inference_stats"][kind]["count"]
    return count


def _disagreeing(snapshot: dict[str, dict[str, Any]], models: list[str]) -> dict[str, Any]:
    return {
        name: counts
        for name in models
        if len(set((counts := _counts(snapshot[name])).values())) != 1
    }


def test_every_snapshot_under_load_has_equal_per_request_counts(
    stats_service: Service, models_dir: Path
) -> None:
    # GIVEN a GPU service serving digits and the topics pipeline (minilm -> topics-head)
    images = np.load(models_dir / "digits" / "samples" / "images.npy").astype(np.float32)
    one, eight = _digits_body(images[:1]), _digits_body(images[:8])
    assert len(one) < INLINE_PARSE_BYTES < len(eight)
    numbers = itertools.count()

    def topics() -> bytes:
        # Each text differs, so the cacheable minilm step computes every time.
        return _topics_body(f"The match number {next(numbers)} went to extra time.")

    loads: list[tuple[str, Callable[[], bytes]]] = [
        *[("/v2/models/digits/infer", lambda: one)] * 8,
        *[("/v2/models/digits/infer", lambda: eight)] * 8,
        *[("/v2/models/topics/infer", topics)] * 2,
    ]
    # the pipeline too: perf_analyzer finds the version it measures by its queue count
    watched = ["digits", "minilm", "topics-head", "topics"]
    snapshots: list[dict[str, dict[str, Any]]] = []
    stop = threading.Event()
    watcher = http.client.HTTPConnection("127.0.0.1", stats_service.port, timeout=60)
    before, metrics_before = _snapshot(watcher), _metrics(watcher)
    # WHEN 18 clients send requests back to back for a few seconds while statistics are
    # read as fast as the service answers
    with ThreadPoolExecutor(len(loads)) as pool:
        running = [pool.submit(_load, stats_service, p, b, stop) for p, b in loads]
        deadline = time.monotonic() + LOAD_S
        try:
            while time.monotonic() < deadline and not any(f.done() for f in running):
                snapshots.append(_snapshot(watcher))
        finally:
            stop.set()
        served = [f.result() for f in running]
    after, metrics_after = _snapshot(watcher), _metrics(watcher)
    watcher.close()
    # THEN every snapshot agrees with itself for every model perf_analyzer would read
    bad = [d for s in snapshots if (d := _disagreeing(s, watched))]
    assert len(snapshots) >= 20
    per_model = {name: sum(name in d for d in bad) for name in watched}
    assert not bad, f"of {len(snapshots)} snapshots, disagreeing {per_model}; first {bad[0]}"
    # ... and once the load has ended, each count is the number of requests served
    digits_served, topics_served = sum(served[:16]), sum(served[16:])
    assert digits_served > 0
    assert topics_served > 0
    growth = {
        name: {kind: _grown(before[name], after[name], kind) for kind in PER_REQUEST}
        for name in watched
    }
    assert growth["digits"] == dict.fromkeys(PER_REQUEST, digits_served)
    # every pipeline request ran each step once (no text repeated, so no cache hit)
    assert growth["minilm"] == dict.fromkeys(PER_REQUEST, topics_served)
    assert growth["topics-head"] == dict.fromkeys(PER_REQUEST, topics_served)
    assert growth["topics"] == dict.fromkeys(PER_REQUEST, topics_served)
    # ... and /metrics, which reads the same counters, says the same
    grown = {k: metrics_after[k] - metrics_before.get(k, 0.0) for k in metrics_after}
    assert grown['nv_inference_request_success{model="digits",version="1"}'] == digits_served
    assert grown['nv_inference_request_success{model="minilm",version="1"}'] == topics_served
    assert grown['spillway_pipeline_request_success_total{pipeline="topics"}'] == topics_served
    rows = after["digits"]["inference_count"] - before["digits"]["inference_count"]
    assert rows == sum(served[:8]) + 8 * sum(served[8:16])
