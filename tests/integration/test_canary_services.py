"""A canary on real services: the GPU service with digits v1 and a v2 built to fail 20 %
of its inputs (ONNX Runtime errors), the router over HTTP to it with its state table on
a moto server, the canary started by ``config.json`` and rolled back by the router;
``spillway models status`` and the CPU fallback read the same repository and table."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
from typer.testing import CliRunner
from werkzeug.test import Client

from spillway.canary.records import CanaryStore
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.canary_spec import RollbackBounds
from spillway.models.repository import LocalRepository
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway.state.table import DynamoStateStore, create_table
from spillway_cli.main import app as cli
from spillway_cli.modelbuild.faulty import publish_faulty_canary
from tests.support import gpu_service, link_model

WINDOW_S = 30.0
BOUNDS = RollbackBounds(window_s=WINDOW_S, min_requests=30)


@pytest.fixture
def canary_repo(models_dir: Path, tmp_path: Path) -> Path:
    """digits v1 and, as v2, a variant failing 20 % of inputs, named the 10 % canary."""
    root = tmp_path / "repo"
    root.mkdir()
    link_model(models_dir, root, "digits")
    versions = publish_faulty_canary(
        LocalRepository(root),
        "digits",
        share=0.2,
        percent=10,
        workdir=tmp_path / "work",
        bounds=BOUNDS,
    )
    assert versions == (1, 2)
    return root


@pytest.fixture
def state_table(aws_env: str) -> str:
    name = f"router-state-{random.randrange(10**9)}"
    create_table(boto3.client("dynamodb"), name)
    return name


def _body(image: np.ndarray) -> bytes:
    tensor = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32"}
    return json.dumps({"inputs": [{**tensor, "data": image.ravel().tolist()}]}).encode()


def test_a_failing_canary_is_rolled_back_and_stable_sessions_never_fail(
    canary_repo: Path, models_dir: Path, state_table: str, tmp_path: Path
) -> None:
    images = np.load(models_dir / "digits/samples/images.npy").astype(np.float32)
    with gpu_service(canary_repo, tmp_path / "logs") as gpu:
        # GIVEN a router over the GPU service and the shared state table
        settings = RouterSettings(
            gpu_url=gpu.base,
            state_table=state_table,
            canary_ttl_s=1.0,
            canary_seed=4,
            metrics_log=tmp_path / "metrics.jsonl",
        )
        router = Client(create_app(settings))
        draw = random.Random(9)
        first: dict[str, str] = {}
        failures: Counter[str] = Counter()
        statuses: Counter[str] = Counter()
        store = CanaryStore(
            DynamoStateStore(state_table, lambda: boto3.client("dynamodb")), time.time
        )
        # WHEN 40 sessions and unsessioned callers send digits until the canary is rolled back
        rolled_back = None
        for step in range(4000):
            session = f"user-{step % 40}" if step % 2 else None
            headers = {"x-spillway-session": session} if session else {}
            body = _body(images[draw.randrange(len(images))])
            answer = router.post("/v2/models/digits/infer", data=body, headers=headers)
            version = answer.headers["x-spillway-model-version"]
            statuses[f"v{version}:{answer.status_code}"] += 1
            if session is not None:
                first.setdefault(session, version)
                failures[first[session]] += answer.status_code != 200
            if step % 50 == 49 and (state := store.load("digits")) and state.status != "running":
                rolled_back = state
                break
        # THEN the config's canary ran at 10 % and was rolled back within its window
        assert rolled_back is not None, statuses
        started, rollback = rolled_back.history[0], rolled_back.history[-1]
        assert started.reason == "config.json"
        assert rollback.event == "rolled_back"
        assert "fault rate" in rollback.reason
        assert rollback.at - started.at <= WINDOW_S
        # AND only the canary failed (500s), never a session on the stable version
        assert set(statuses) <= {"v1:200", "v2:200", "v2:500"}, statuses
        assert statuses["v2:500"] > 0
        assert failures["1"] == 0
        assert set(first.values()) == {"1", "2"}
        # AND after the rollback every caller, canary sessions too, gets v1 and succeeds
        after: Counter[str] = Counter()
        for step in range(100):
            headers = {"x-spillway-session": f"user-{step % 40}"} if step % 2 else {}
            answer = router.post(
                "/v2/models/digits/infer", data=_body(images[step]), headers=headers
            )
            after[f"v{answer.headers['x-spillway-model-version']}:{answer.status_code}"] += 1
        assert after == Counter({"v1:200": 100})
        # AND the rollback is a metric and shows in `spillway models status`
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert sum("CanaryRollback" in line for line in lines) == 1
        status = CliRunner().invoke(cli, ["models", "status", "digits", "--table", state_table])
        assert status.exit_code == 0, status.output
        assert "canary v2 at 0% (rolled back)" in status.output
        assert "fault rate" in status.output
        # AND a request that pins v2 is refused by the router, until the operator allows it
        pinned = "/v2/models/digits/versions/2/infer"
        refused = router.post(pinned, data=_body(images[0]))
        assert refused.status_code == 409
        assert json.loads(refused.data)["code"] == "version_rolled_back"
        assert "requests that pin them are refused" in status.output
        allow = ["models", "canary", "--model", "digits", "--allow-pinned", "--table", state_table]
        allowed = CliRunner().invoke(cli, allow)
        assert allowed.exit_code == 0, allowed.output
        assert "rolled back: v2; requests that pin them are served" in allowed.output
        served = _first_answer(lambda: router.post(pinned, data=_body(images[0])), 409, 10.0)
        assert served.status_code in (200, 500)  # v2 fails a fifth of its inputs by design
        assert served.headers["x-spillway-model-version"] == "2"


def _first_answer(send: Any, unwanted: int, within_s: float) -> Any:
    """The first answer of ``send()`` whose status is not ``unwanted`` (the routers follow a
    changed record within their cache period), tried until ``within_s`` has passed."""
    deadline = time.monotonic() + within_s
    answer = send()
    while answer.status_code == unwanted and time.monotonic() < deadline:
        answer = send()
    return answer


def test_the_cpu_fallback_serves_both_versions_and_the_stable_one_by_default(
    canary_repo: Path, tmp_path: Path
) -> None:
    service = CpuService.load(
        CpuSettings(repository=str(canary_repo), models=["digits"], cache_dir=tmp_path / "cache")
    )
    assert sorted(service.models["digits"]) == [1, 2]
    assert service.get("digits", None).version == 1
    assert service.get("digits", "2").version == 2


def test_the_cli_starts_changes_and_promotes_a_canary(state_table: str) -> None:
    runner = CliRunner()

    def run(*args: str) -> Any:
        result = runner.invoke(cli, ["models", *args, "--table", state_table])
        return result

    refused = run("canary", "--model", "digits", "--version", "2", "--percent", "10")
    assert refused.exit_code == 1
    assert "name the stable version" in refused.output
    started = run(
        "canary",
        "--model",
        "digits",
        "--version",
        "2",
        "--percent",
        "10",
        "--stable",
        "1",
        "--min-requests",
        "80",
    )
    assert started.exit_code == 0, started.output
    assert "stable v1, canary v2 at 10% (running)" in started.output
    assert "at least 80 requests" in started.output
    raised = run("canary", "--model", "digits", "--version", "2", "--percent", "100")
    assert "canary v2 at 100% (running)" in raised.output
    wrong = run("canary", "--model", "digits", "--version", "3", "--promote")
    assert wrong.exit_code == 1
    promoted = run("canary", "--model", "digits", "--promote")
    assert promoted.exit_code == 0, promoted.output
    assert "digits: stable v2, no canary" in promoted.output
    document = json.loads(run("status", "digits", "--json").output)
    assert [e["event"] for e in document["history"]] == ["started", "percent", "promoted"]
    assert document["bounds"]["min_requests"] == 80
