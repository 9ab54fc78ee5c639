"""The router Lambda handler driven with events/router/*.json, as ``sam local invoke -e``
would, in front of a real GPU service process and a real CPU-fallback HTTP server."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import functions.router.handler as router_handler
from spillway.fallback.app import CpuApp
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway_cli.local.wsgi_server import running
from tests.lambda_context import LambdaContext
from tests.support import Service

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "events" / "router"
EXAMPLE = ROOT / "policies" / "example.yaml"


@pytest.fixture(scope="module")
def cpu_url(models_dir: Path) -> Iterator[str]:
    cpu = CpuService.load(CpuSettings(repository=str(models_dir), models=["digits"]))
    with running(CpuApp(cpu)) as url:
        yield url


@pytest.fixture
def routed(service: Service, cpu_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The handler's application pointed at the real backends; returns the metrics log."""
    metrics = tmp_path / "metrics.log"
    settings = RouterSettings(
        gpu_url=service.base, cpu_url=cpu_url, policy_file=EXAMPLE, metrics_log=metrics
    )
    monkeypatch.setattr(router_handler, "app", create_app(settings))
    return metrics


def event(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((EVENTS / name).read_text())
    return document


def headers_of(response: dict[str, Any]) -> dict[str, str]:
    if "multiValueHeaders" in response:
        return {k.lower(): v[0] for k, v in response["multiValueHeaders"].items()}
    return {k.lower(): v for k, v in response["headers"].items()}


def body_of(response: dict[str, Any]) -> Any:
    raw = response.get("body") or ""
    data = base64.b64decode(raw) if response.get("isBase64Encoded") else raw.encode()
    return json.loads(data) if data else None


@pytest.mark.parametrize(
    ("name", "status", "rule", "backend"),
    [
        ("infer-rest-v1.json", 200, "default", "gpu"),
        ("infer-http-v2.json", 200, "default", "gpu"),
        ("infer-http-v2-stage.json", 200, "realtime", "gpu"),
        ("serverless-rest-v1.json", 200, "serverless-requested", "cpu"),
        # No jobs API in this stack: batch mode is not offered (a client error, 400).
        ("batch-http-v2.json", 400, "batch-requested", "none"),
        ("metadata-http-v2.json", 200, "default", "gpu"),
    ],
)
def test_events_are_routed_as_the_policy_says(
    routed: Path, models_dir: Path, name: str, status: int, rule: str, backend: str
) -> None:
    # GIVEN an API Gateway event from events/router
    # WHEN the Lambda handler serves it
    response = router_handler.handler(event(name), LambdaContext())
    # THEN the status, the rule that fired and the backend are the expected ones
    headers = headers_of(response)
    assert response["statusCode"] == status, response.get("body")
    assert headers["x-spillway-rule"] == rule
    assert headers["x-spillway-backend"] == backend
    body = body_of(response)
    if name.startswith("infer") or name.startswith("serverless"):
        label = int(np.load(models_dir / "digits" / "samples" / "labels.npy")[0])
        assert body["outputs"] == [
            {"name": "label", "datatype": "INT64", "shape": [1, 1], "data": [label]}
        ]
        assert body["id"] == "post-1"
    elif name.startswith("metadata"):
        assert body["name"] == "digits"
    else:
        assert "ROUTER_JOBS_URL" in body["error"]
    # AND one EMF line accounts for it
    (line,) = routed.read_text().splitlines()
    assert json.loads(line)["rule"] == rule


def test_health_event_needs_no_backend(routed: Path) -> None:
    response = router_handler.handler(event("ready-rest-v1.json"), LambdaContext())
    assert response["statusCode"] == 200
    assert body_of(response) == {"ready": True}


def test_a_nearly_expired_invocation_is_not_forwarded(routed: Path) -> None:
    # GIVEN a Lambda invocation with less time left than the deadline margin
    response = router_handler.handler(event("infer-http-v2.json"), LambdaContext(remaining_ms=100))
    # THEN the router answers 504 without trying a backend
    assert response["statusCode"] == 504
    assert body_of(response)["code"] == "deadline_exceeded"


def test_the_handler_in_a_fresh_process_like_sam_local_invoke(service: Service) -> None:
    # GIVEN the handler module imported by a new interpreter with ROUTER_* settings
    script = (
        "import json, sys\n"
        "from functions.router.handler import handler\n"
        "from tests.lambda_context import LambdaContext\n"
        "for path in sys.argv[1:]:\n"
        "    print('RESPONSE', json.dumps(handler(json.load(open(path)), LambdaContext())))\n"
    )
    env = {
        **os.environ,
        "ROUTER_GPU_URL": service.base,
        "ROUTER_POLICY_FILE": str(EXAMPLE),
        "ROUTER_LOG_LEVEL": "WARNING",
        "ROUTER_METRICS_LOG": os.devnull,
    }
    files = [str(EVENTS / n) for n in ("infer-rest-v1.json", "infer-http-v2-stage.json")]
    done = subprocess.run(
        [sys.executable, "-c", script, *files],
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    # (the handler's own log lines share stdout, as on Lambda)
    out = done.stdout.decode()
    responses = [json.loads(line[9:]) for line in out.splitlines() if line.startswith("RESPONSE ")]
    assert [r["statusCode"] for r in responses] == [200, 200], out[-2000:]
    assert [headers_of(r)["x-spillway-rule"] for r in responses] == ["default", "realtime"]
