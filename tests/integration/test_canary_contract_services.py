"""The canary × CPU fallback scenario on real services: the GPU service (a process), the
CPU fallback and the router (WSGI servers), all on 127.0.0.1, reading one model
repository on S3 (moto) and one state table. The CPU fallback starts before the canary
version is published, as a Lambda environment that has been warm for a while would."""

from __future__ import annotations

import http.client
import json
import random
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import numpy as np
import pytest
from typer.testing import CliRunner

from spillway.canary.records import CanaryStore
from spillway.fallback.app import CpuApp
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.config import CHECKSUM_FILE
from spillway.models.repository import S3Repository
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway.state.table import DynamoStateStore, create_table
from spillway_cli.local.wsgi_server import running
from spillway_cli.main import app as cli
from tests.support import gpu_service

MODEL = "digits"
SERVERLESS = {"x-spillway-mode": "serverless"}


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def version(self) -> str:
        return self.headers.get("x-spillway-model-version", "")

    def key(self) -> str:
        return f"v{self.version}:{self.status}"


def post(base: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> Answer:
    """One request over a fresh HTTP/1.1 connection to 127.0.0.1."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)
    try:
        conn.request("POST", path, body, {"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        answer = Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, b"")
        answer.body = response.read()
        return answer
    finally:
        conn.close()


def infer_body(image: np.ndarray) -> bytes:
    tensor = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32"}
    return json.dumps({"inputs": [{**tensor, "data": image.ravel().tolist()}]}).encode()


@pytest.fixture
def s3_repo(aws_env: str, models_dir: Path, tmp_path: Path) -> S3Repository:
    """digits v1 alone under an S3 prefix (its default policy serves the newest)."""
    s3 = boto3.client("s3")
    bucket = f"contract-{random.randrange(10**9)}"
    s3.create_bucket(Bucket=bucket)
    for path in (models_dir / MODEL).rglob("*"):
        if path.is_file() and "samples" not in path.parts:
            key = f"repo/{MODEL}/{path.relative_to(models_dir / MODEL).as_posix()}"
            s3.upload_file(str(path), bucket, key)
    return S3Repository(bucket, "repo", s3)


@pytest.fixture
def state_table(aws_env: str) -> str:
    name = f"router-state-{random.randrange(10**9)}"
    create_table(boto3.client("dynamodb"), name)
    return name


def publish(repo: S3Repository, workdir: Path, *, serve: list[int] | None) -> int:
    """Publish a copy of v1 as the next version; ``serve``: the version_policy's list
    (``None`` leaves the configuration as it is)."""
    folder = repo.fetch_version(MODEL, 1, workdir / "fetched")
    files = {p.name: p for p in folder.iterdir() if p.is_file() and p.name != CHECKSUM_FILE}
    config = None
    if serve is not None:
        document = repo.read_config(MODEL).model_dump(mode="json")
        document["version_policy"] = {"specific": {"versions": serve}}
        config = type(repo.read_config(MODEL)).model_validate(document)
    version = repo.publish_version(MODEL, files, config)
    shutil.rmtree(workdir / "fetched")
    return version


@pytest.fixture
def cpu_service(s3_repo: S3Repository, tmp_path: Path) -> CpuService:
    """The CPU fallback, loaded while digits has one version."""
    settings = CpuSettings(
        repository=f"s3://{s3_repo.bucket}/repo",
        models=[MODEL],
        cache_dir=tmp_path / "cpu-cache",
        index_miss_refresh_s=0,
    )
    return CpuService.load(settings)


@pytest.fixture
def cpu_url(cpu_service: CpuService) -> Iterator[str]:
    with running(CpuApp(cpu_service)) as url:
        yield url


def canary(table: str, *args: str) -> Any:
    return CliRunner().invoke(cli, ["models", "canary", "--model", MODEL, *args, "--table", table])


def test_a_canary_on_the_local_stack_never_answers_404(
    s3_repo: S3Repository,
    cpu_service: CpuService,
    cpu_url: str,
    state_table: str,
    models_dir: Path,
    tmp_path: Path,
) -> None:
    images = np.load(models_dir / MODEL / "samples/images.npy").astype(np.float32)
    bodies = [infer_body(images[i % len(images)]) for i in range(40)]
    assert sorted(cpu_service.models[MODEL]) == [1]
    location = f"s3://{s3_repo.bucket}/repo"
    with gpu_service(location, tmp_path / "logs", model_control_mode="explicit") as gpu:
        # GIVEN digits v2 published (a policy serving v1 and v2) after the CPU fallback
        # started, and loaded by the GPU service
        assert publish(s3_repo, tmp_path, serve=[1, 2]) == 2
        load = post(gpu.base, f"/v2/repository/models/{MODEL}/load", b"")
        assert load.status == 200, load.body
        settings = RouterSettings(
            gpu_url=gpu.base,
            cpu_url=cpu_url,
            state_table=state_table,
            # Read the record on every request: each phase starts with the record it set.
            canary_ttl_s=0,
            canary_seed=4,
            metrics_log=tmp_path / "metrics.jsonl",
        )
        with running(create_app(settings)) as router:
            # AND v2 started as a 50 % canary with `spillway models canary`, which says
            # which backends serve it
            started = canary(
                state_table, "--version", "2", "--percent", "50", "--stable", "1",
                "--gpu-url", gpu.base, "--cpu-url", cpu_url,
            )  # fmt: skip
            assert started.exit_code == 0, started.output
            assert "v2: gpu serves it, cpu serves it" in started.output
            # WHEN 40 serverless-mode requests arrive
            answers = [post(router, f"/v2/models/{MODEL}/infer", b, SERVERLESS) for b in bodies]
            # THEN none is a 404: the CPU fallback loaded v2 on demand and served it
            served = Counter(a.key() for a in answers)
            assert served["v2:404"] == 0, served
            assert set(served) == {"v1:200", "v2:200"}, served
            assert {a.headers["x-spillway-backend"] for a in answers} == {"cpu"}
            assert sorted(cpu_service.models[MODEL]) == [1, 2]

            # GIVEN v3 published without a policy that serves it: no backend serves v3
            assert publish(s3_repo, tmp_path, serve=None) == 3
            moved = canary(state_table, "--version", "3", "--percent", "50")
            assert moved.exit_code == 0, moved.output
            # WHEN 120 requests arrive
            answers = [post(router, f"/v2/models/{MODEL}/infer", b) for b in bodies * 3]
            # THEN every one is served by the stable version (no 404), and the choice
            # was counted
            assert Counter(a.key() for a in answers) == Counter({"v1:200": 120})
            metrics = (tmp_path / "metrics.jsonl").read_text()
            assert metrics.count("CanaryVersionUnserved") > 0
            # AND `models canary --promote` refuses v3, naming the backends that lack it
            refused = canary(state_table, "--promote", "--gpu-url", gpu.base, "--cpu-url", cpu_url)
            assert refused.exit_code == 1
            assert "v3: gpu does not serve it, cpu does not serve it" in refused.output
            assert "v3 of digits is not served by gpu, cpu" in refused.output
            state = CanaryStore(
                DynamoStateStore(state_table, lambda: boto3.client("dynamodb")), lambda: 0.0
            ).load(MODEL)
            assert state is not None
            assert (state.stable, state.canary) == (1, 3)

            # GIVEN the canary back on v2 at 50 %, and the GPU service gone
            again = canary(state_table, "--version", "2", "--percent", "50")
            assert again.exit_code == 0, again.output
            gpu.child.stop()
            # WHEN 40 requests arrive (the GPU service first, then the CPU fallback)
            answers = [post(router, f"/v2/models/{MODEL}/infer", b) for b in bodies]
            # THEN the CPU fallback served all of them, v2 among them: no 404
            outage = Counter(a.key() for a in answers)
            assert set(outage) <= {"v1:200", "v2:200"}, outage
            assert outage["v2:200"] > 0
