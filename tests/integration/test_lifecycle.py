"""Model lifecycle over real HTTP: hot swap under load, broken versions, cold starts,
idle TTL, memory budget, S3 repository, and the control API's guards."""

from __future__ import annotations

import http.client
import json
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from spillway.aws.clients import aws_client
from spillway.models.repository import LocalRepository, open_repository
from tests.fakes import eventually
from tests.support import Service, gpu_service, link_model

IMAGE = [[0.0] * 8 for _ in range(8)]
BODY = json.dumps(
    {"inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [IMAGE]}]}
).encode()


def _call(
    svc: Service, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=120)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def _metric(svc: Service, name: str, model: str) -> float:
    _, _, raw = _call(svc, "GET", "/metrics")
    for line in raw.decode().splitlines():
        if line.startswith(f'{name}{{model="{model}"'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {model} not in /metrics")


@pytest.fixture
def repo(models_dir: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    link_model(models_dir, root, "digits")
    shutil.rmtree(root / "digits" / "samples")
    return root


def test_hot_swap_under_load_fails_nothing(repo: Path, models_dir: Path, tmp_path: Path) -> None:
    # GIVEN version 1 serving and 8 clients sending requests back to back
    with gpu_service(repo, tmp_path / "logs", model_control_mode="explicit") as svc:
        stop = threading.Event()
        seen: list[list[tuple[int, str]]] = [[] for _ in range(8)]

        def client(index: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=60)
            while not stop.is_set() or len(seen[index]) < 250:
                conn.request("POST", "/v2/models/digits/infer", body=BODY)
                response = conn.getresponse()
                body = response.read()
                version = json.loads(body).get("model_version", "?")
                seen[index].append((response.status, version))
            conn.close()

        def settled(condition: Callable[[], bool]) -> Callable[[], bool]:
            """The condition, or a client that ended early (its error surfaces below)."""
            return lambda: condition() or any(f.done() for f in futures)

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(client, i) for i in range(8)]
            eventually(settled(lambda: sum(len(s) for s in seen) >= 300), "300 answers")
            # WHEN version 2 is published and loaded while they run
            LocalRepository(repo).publish_version(
                "digits", {"model.onnx": models_dir / "digits/1/model.onnx"}
            )
            status, _, body = _call(svc, "POST", "/v2/repository/models/digits/load")
            assert status == 200, body
            eventually(
                settled(lambda: all(any(v == "2" for _, v in list(s)) for s in seen)),
                "every client is served by version 2",
            )
            stop.set()
            for future in futures:
                future.result()
        # THEN no request failed, and each client saw version 1, then only version 2
        results = [r for client_seen in seen for r in client_seen]
        assert len(results) >= 2000
        assert {status for status, _ in results} == {200}
        for client_seen in seen:
            versions = [v for _, v in client_seen]
            switch = versions.index("2")
            assert set(versions[:switch]) == {"1"}
            assert set(versions[switch:]) == {"2"}
        index = json.loads(_call(svc, "POST", "/v2/repository/index")[2])
        states = {r["version"]: r["state"] for r in index if r["name"] == "digits"}
        assert states == {"1": "UNAVAILABLE", "2": "READY"}


def test_broken_version_keeps_the_old_one_serving(
    repo: Path, models_dir: Path, tmp_path: Path
) -> None:
    with gpu_service(repo, tmp_path / "logs", model_control_mode="explicit") as svc:
        # GIVEN version 2 whose file no longer matches its checksum
        LocalRepository(repo).publish_version(
            "digits", {"model.onnx": models_dir / "digits/1/model.onnx"}
        )
        (repo / "digits/2/model.onnx").write_bytes(b"tampered")
        # WHEN it is loaded THEN the control call reports it
        status, _, body = _call(svc, "POST", "/v2/repository/models/digits/load")
        assert (status, json.loads(body)["code"]) == (500, "checksum_mismatch")
        # AND version 1 keeps serving
        status, _, body = _call(svc, "POST", "/v2/models/digits/infer", BODY)
        assert (status, json.loads(body)["model_version"]) == (200, "1")
        index = json.loads(_call(svc, "POST", "/v2/repository/index")[2])
        v2 = next(r for r in index if r["name"] == "digits" and r["version"] == "2")
        assert v2["state"] == "UNAVAILABLE"
        assert "sha256" in v2["reason"]
        assert _metric(svc, "spillway_model_load_failures_total", "digits") == 1


def test_fifty_first_requests_share_one_cold_start(repo: Path, tmp_path: Path) -> None:
    with gpu_service(
        repo, tmp_path / "logs", model_control_mode="explicit", startup_models="[]"
    ) as svc:
        assert _metric(svc, "spillway_model_loads_total", "digits") == 0
        with ThreadPoolExecutor(50) as pool:
            results = list(
                pool.map(lambda _: _call(svc, "POST", "/v2/models/digits/infer", BODY), range(50))
            )
        assert [s for s, _, _ in results] == [200] * 50
        assert any("x-spillway-cold-start-ms" in h for _, h, _ in results)
        assert _metric(svc, "spillway_model_loads_total", "digits") == 1
        assert _metric(svc, "spillway_cold_starts_total", "digits") == 1


def test_idle_ttl_unloads_then_cold_starts(repo: Path, tmp_path: Path) -> None:
    # GIVEN a model with a 1 s idle TTL, used once
    with gpu_service(repo, tmp_path / "logs", idle_ttl_s="1") as svc:
        assert _call(svc, "POST", "/v2/models/digits/infer", BODY)[0] == 200
        # WHEN it stays idle for longer than the TTL THEN it is unloaded
        eventually(
            lambda: _call(svc, "GET", "/v2/models/digits/ready")[0] != 200,
            "the idle model is unloaded",
            interval_s=0.1,
        )
        assert _metric(svc, "spillway_model_loads_total", "digits") == 1
        # AND the next request loads it again, as a cold start
        status, headers, _ = _call(svc, "POST", "/v2/models/digits/infer", BODY)
        assert status == 200
        assert "x-spillway-cold-start-ms" in headers
        assert _metric(svc, "spillway_model_loads_total", "digits") == 2


def test_load_that_cannot_fit_gives_503_with_retry_after(repo: Path, tmp_path: Path) -> None:
    with gpu_service(
        repo, tmp_path / "logs", wait_path="/v2/health/live", memory_budget_mb="0.001"
    ) as svc:
        status, headers, body = _call(svc, "POST", "/v2/models/digits/infer", BODY)
        assert (status, json.loads(body)["code"]) == (503, "model_not_ready")
        assert "retry-after" in headers
        assert "budget" in json.loads(body)["error"]
        assert _call(svc, "GET", "/v2/health/ready")[0] == 400


def test_control_api_is_guarded(repo: Path, tmp_path: Path) -> None:
    with gpu_service(repo, tmp_path / "logs") as svc:
        status, _, body = _call(svc, "POST", "/v2/repository/models/digits/unload")
        assert (status, json.loads(body)["code"]) == (400, "control_disabled")
    with gpu_service(
        repo,
        tmp_path / "logs2",
        model_control_mode="explicit",
        admin_token="local-test-token",  # noqa: S106
    ) as svc:
        assert _call(svc, "POST", "/v2/repository/models/digits/unload")[0] == 401
        auth = {"Authorization": "Bearer local-test-token"}
        assert _call(svc, "POST", "/v2/repository/models/digits/unload", headers=auth)[0] == 200
        assert _call(svc, "GET", "/v2/models/digits/ready")[0] == 400


def test_s3_repository_and_checksum_refusal(
    aws_env: str, repo: Path, models_dir: Path, tmp_path: Path
) -> None:
    client: Any = aws_client("s3", "us-east-1")
    client.create_bucket(Bucket="lifecycle-models")
    for path in sorted((repo / "digits").rglob("*")):
        if path.is_file():
            key = f"prod/{path.relative_to(repo).as_posix()}"
            client.upload_file(str(path), "lifecycle-models", key)
    location = "s3://lifecycle-models/prod"
    settings: dict[str, Any] = {
        "model_control_mode": "explicit",
        "cache_dir": str(tmp_path / "cache"),
    }
    with gpu_service(location, tmp_path / "logs", **settings) as svc:
        assert _call(svc, "POST", "/v2/models/digits/infer", BODY)[0] == 200
        s3_repo = open_repository("s3://lifecycle-models/prod")
        s3_repo.publish_version("digits", {"model.onnx": models_dir / "digits/1/model.onnx"})
        client.put_object(
            Bucket="lifecycle-models", Key="prod/digits/2/model.onnx", Body=b"tampered"
        )
        status, _, body = _call(svc, "POST", "/v2/repository/models/digits/load")
        assert (status, json.loads(body)["code"]) == (500, "checksum_mismatch")
        status, _, body = _call(svc, "POST", "/v2/models/digits/infer", BODY)
        assert (status, json.loads(body)["model_version"]) == (200, "1")
