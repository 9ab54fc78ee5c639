"""Data capture wired into the router (``create_app`` with ``ROUTER_CAPTURE_ROOT``): one
record per request, failures included, in each tenant's own area; a stalled S3 never
holds a request, and the buffer stays within its bound."""

from __future__ import annotations

import io
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from werkzeug.test import Client

from spillway.capture.layout import Area
from spillway.capture.watcher import Capture
from spillway.policy.backend import BackendRequest, BackendResponse
from spillway.router.app import RouterApp
from spillway.router.batch_mode import BatchBackend
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway.state.table import scope
from tests.fakes import eventually
from tests.unit.capture_support import BODY, RESULT, Clock, MemoryS3
from tests.unit.router_support import fake_overrides

ROOT = "s3://captures/router"
POLICY = """
rules:
  - name: serverless-requested
    match: {mode: [serverless]}
    route: cpu
  - name: default
    route: gpu
capture:
  - {model: minilm, sample: 0}
  - {model: "*", sample: 1}
"""
BAD_SHAPE = (
    b'{"error":"input image: shape [1, 3] does not match [-1, 8, 8]","code":"invalid_input"}'
)


@dataclass
class Gpu:
    """Answers 200, or 400 for a body that names shape [1, 3]."""

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        if b"[1,3]" in request.body or b"[1, 3]" in request.body:
            return BackendResponse(400, {"content-type": "application/json"}, BAD_SHAPE, 0.001)
        headers = {"content-type": "application/json", "x-spillway-model-version": "1"}
        return BackendResponse(200, headers, RESULT, 0.001)


def _app(tmp_path: Path, s3: MemoryS3, **settings: Any) -> tuple[RouterApp, Capture]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    backends: dict[str, Any] = {"gpu": Gpu(), "batch": BatchBackend(None)}
    overrides = fake_overrides(backends, Clock(), io.StringIO())
    overrides.capture_s3 = s3
    config = RouterSettings(
        policy_file=policy,
        trust_tenant_hints=True,
        capture_root=ROOT,
        **settings,
    )
    app = create_app(config, overrides)
    capture = app.router.watch
    assert isinstance(capture, Capture)
    return app, capture


@pytest.fixture
def s3() -> MemoryS3:
    return MemoryS3()


def _post(
    app: RouterApp, tenant: str, body: bytes = BODY, headers: dict[str, str] | None = None
) -> Any:
    sent = {"x-spillway-tenant": tenant, "content-type": "application/json", **(headers or {})}
    return Client(app).post("/v2/models/digits/infer", data=body, headers=sent)


def test_without_a_root_there_is_no_capture() -> None:
    backends: dict[str, Any] = {"gpu": Gpu(), "batch": BatchBackend(None)}
    app = create_app(RouterSettings(), fake_overrides(backends, Clock(), io.StringIO()))
    assert app.router.watch is None


def test_each_request_is_one_record_in_its_tenants_area(tmp_path: Path, s3: MemoryS3) -> None:
    app, capture = _app(tmp_path, s3)
    try:
        # GIVEN a 200, the backend's 400 and the router's 503 for tenant acme, a 200 for
        # globex, and a model the policy samples at 0
        assert _post(app, "acme").status_code == 200
        bad = BODY.replace(b"[1, 8, 8]", b"[1, 3]")
        assert _post(app, "acme", bad).status_code == 400
        assert _post(app, "acme", headers={"x-spillway-mode": "serverless"}).status_code == 503
        assert _post(app, "globex").status_code == 200
        client = Client(app)
        client.post("/v2/models/minilm/infer", data=BODY, headers={"x-spillway-tenant": "acme"})
        client.get("/v2/models/digits", headers={"x-spillway-tenant": "acme"})
        # WHEN the buffer is written
        assert capture.flush() == 4
    finally:
        capture.close()
    # THEN each tenant's area holds its own records only, every field filled in
    acme = s3.records(Area.of(ROOT, "acme").prefix)
    globex = s3.records(Area.of(ROOT, "globex").prefix)
    assert [(r.tenant, r.status) for r in acme] == [("acme", 200), ("acme", 400), ("acme", 503)]
    assert [(r.tenant, r.status) for r in globex] == [("globex", 200)]
    ok, refused, unserved = acme
    assert (ok.backend, ok.version, ok.rule, ok.model) == ("gpu", "1", "default", "digits")
    assert ok.response is not None
    assert ok.response.data == json.loads(RESULT)
    assert ok.request is not None
    assert ok.request.data == json.loads(BODY)
    assert ok.request_id
    assert ok.latency_ms >= 0
    assert ok.replayable
    assert refused.error is not None
    assert refused.error.code == "invalid_input"
    assert refused.backend == "gpu"
    assert unserved.backend is None
    assert unserved.rule == "serverless-requested"
    assert unserved.error is not None
    assert unserved.error.code == "unavailable"
    assert all(key.split("/")[1] in (scope("acme"), scope("globex")) for _, key in s3.objects)


def test_a_stalled_s3_never_holds_a_request_and_the_buffer_keeps_its_bound(
    tmp_path: Path,
) -> None:
    # GIVEN a router whose S3 never answers a put, a 64 KiB buffer and batches due at once
    gate = threading.Event()
    s3 = MemoryS3(gate=gate)
    app, capture = _app(
        tmp_path, s3, capture_buffer_bytes=64 * 1024, capture_max_record_bytes=16 * 1024
    )
    bound = capture.buffer.max_bytes
    try:
        # WHEN 200 requests are sent
        started = time.monotonic()
        statuses = []
        for _ in range(200):
            statuses.append(_post(app, "acme").status_code)
            assert capture.buffer.bytes <= bound
        elapsed = time.monotonic() - started
        # THEN every request is answered at once, and what does not fit is dropped, counted
        assert statuses == [200] * 200
        assert elapsed < 10
        eventually(lambda: s3.puts >= 1, "the writer stuck in a put", timeout_s=10)
        assert capture.buffer.dropped > 0
        assert capture.buffer.accepted + capture.buffer.dropped == 200
    finally:
        gate.set()
        capture.close()


def test_invented_model_names_never_become_key_prefixes(tmp_path: Path, s3: MemoryS3) -> None:
    app, capture = _app(tmp_path, s3)
    invented = [f"no-such-model-{n}" for n in range(5)]

    class Unknown:
        """Knows digits only: 404 for any other model."""

        name = "gpu"

        def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
            if request.model == "digits":
                return Gpu().send(request, timeout_s)
            body = b'{"error":"unknown model","code":"model_not_found"}'
            return BackendResponse(404, {"content-type": "application/json"}, body, 0.001)

    app.router.backends["gpu"] = Unknown()
    try:
        # GIVEN requests for five invented model names and one for digits
        client = Client(app)
        headers = {"x-spillway-tenant": "acme", "content-type": "application/json"}
        for name in invented:
            assert (
                client.post(f"/v2/models/{name}/infer", data=BODY, headers=headers).status_code
                == 404
            )
        assert _post(app, "acme").status_code == 200
        assert capture.flush() == 6
    finally:
        capture.close()
    # THEN the 404s share one folder, "-", in one object; their records keep the names
    prefix = Area.of(ROOT, "acme").prefix
    folders = sorted({key[len(prefix) :].split("/")[0] for _, key in s3.objects})
    assert folders == ["-", "digits"]
    assert sum(key.startswith(f"{prefix}-/") for _, key in s3.objects) == 1
    records = s3.records(prefix)
    assert sorted(r.model for r in records if r.status == 404) == invented
