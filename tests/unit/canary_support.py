"""Routers over an in-memory state table and a fake backend that serves versions: what
the canary and session tests share."""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass, field
from typing import Any

from werkzeug.test import Client

from spillway.policy.backend import Backend, BackendRequest, BackendResponse
from spillway.router.batch_mode import BatchBackend
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from tests.memory_store import MemoryStateStore
from tests.unit.router_support import fake_overrides

PATH = "/v2/models/digits/infer"


def digits_body(rows: int) -> bytes:
    """An infer request for ``rows`` digits images (about 320 bytes a row)."""
    tensor = {"name": "image", "shape": [rows, 8, 8], "datatype": "FP32", "data": [0.0] * 64 * rows}
    return json.dumps({"inputs": [tensor]}).encode()


BODY = digits_body(1)
VERSION = "x-spillway-model-version"
SESSION = "x-spillway-session"
START = 1_800_000_000.0


class Clock:
    """Epoch seconds that move only when told to (the router's monotonic clock too)."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class VersionedBackend:
    """Serves digits: an unpinned request gets ``default``; each version answers after
    its ``latency`` plus ``per_kib`` for each KiB of the body (the clock moves) and fails
    a ``faults`` share with a server fault or a ``client_errors`` share with
    ``client_status`` (after ``client_error_latency`` when set); ``missing`` versions are
    404. ``canary`` is the ``spillway.canary`` its config serves."""

    clock: Clock
    default: int = 1
    latency: dict[int, float] = field(default_factory=dict)
    faults: dict[int, float] = field(default_factory=dict)
    client_errors: dict[int, float] = field(default_factory=dict)
    client_status: int = 400
    client_error_latency: float | None = None
    per_kib: dict[int, float] = field(default_factory=dict)
    missing: set[int] = field(default_factory=set)
    canary: dict[str, Any] | None = None
    seed: int = 11
    requests: list[BackendRequest] = field(default_factory=list)
    name: str = "gpu"

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        self.requests.append(request)
        if request.operation == "config":
            config = {"name": "digits", "spillway": {"canary": self.canary} if self.canary else {}}
            return BackendResponse(200, {}, json.dumps(config).encode(), 0.001)
        version = int(request.version) if request.version else self.default
        if version in self.missing:
            body = b'{"error":"no such version","code":"model_not_found"}'
            return BackendResponse(404, {}, body, 0.001)
        work = (
            self.latency.get(version, 0.01)
            + self.per_kib.get(version, 0.0) * len(request.body) / 1024
        )
        draw = self._rng.random()
        if draw < self.faults.get(version, 0.0):
            self.clock.advance(work)
            body = b'{"error":"inference failed","code":"inference_failed"}'
            return BackendResponse(500, {"x-spillway-fault": "server"}, body, 0.01)
        if draw < self.faults.get(version, 0.0) + self.client_errors.get(version, 0.0):
            self.clock.advance(self.client_error_latency or work)
            body = b'{"error":"bad input","code":"invalid_input"}'
            return BackendResponse(self.client_status, {}, body, 0.01)
        self.clock.advance(work)
        headers = {"content-type": "application/json", VERSION: str(version)}
        return BackendResponse(200, headers, b'{"model_name":"digits","outputs":[]}', 0.01)

    def infer_paths(self) -> list[str]:
        return [r.path for r in self.requests if r.operation == "infer"]


@dataclass
class RouterUnderTest:
    """One router instance: its WSGI client and its metrics stream."""

    client: Client
    metrics: io.StringIO

    def infer(
        self,
        session: str | None = None,
        *,
        body: bytes = BODY,
        tenant: str | None = None,
        path: str = PATH,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One infer request, as ``tenant`` (vouched for by an authorizer) when given."""
        sent = {**(headers or {}), **({SESSION: session} if session else {})}
        environ = {"serverless.authorizer": {"tenant": tenant}} if tenant else {}
        return self.client.post(path, data=body, headers=sent, environ_overrides=environ)

    def metric_lines(self, name: str) -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in self.metrics.getvalue().splitlines()]
        return [line for line in lines if name in line]


def make_router(
    store: MemoryStateStore, clock: Clock, backend: VersionedBackend, **settings: Any
) -> RouterUnderTest:
    """A router over ``store`` and ``backend`` with the clock for both time sources."""
    metrics = io.StringIO()
    backends: dict[str, Backend] = {"gpu": backend, "batch": BatchBackend(None)}
    overrides = fake_overrides(backends, clock, metrics, state=store)
    settings = {"canary_seed": 5, **settings}
    return RouterUnderTest(Client(create_app(RouterSettings(**settings), overrides)), metrics)
