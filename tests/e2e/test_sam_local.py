"""``sam local invoke`` for real, and the GPU image in real containers (``make sam-local``).

Public image registries are out of reach, so infra/local-images/build.sh builds local
stand-ins of the base images (docs/sam-local.md says what differs) and our images on them. Then
every event in events/ is served by its function under ``sam local invoke`` (the zip
functions from ``sam build``, the CPU fallback from its image) in a container on the host's
network, against the local stack through the env-vars file it writes. The jobs events run
end to end: the submitted job's array children run ``spillway jobs run`` in the GPU image
with ``AWS_BATCH_JOB_ARRAY_INDEX``, and the status event then reports their shards. The GPU
image is held to its entrypoint, health check, non-root user and SIGTERM drain.
"""

from __future__ import annotations

import json
import shutil
import signal
import stat
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest

from batch_job.settings import JobsSettings
from spillway_cli.local.names import REGION
from spillway_cli.local.stack import LocalStack
from tests.e2e.containers import (
    GPU_IMAGE,
    OUT,
    Container,
    Invocation,
    build_images,
    docker,
    require_docker,
    sam_build,
    sam_invoke,
)
from tests.e2e.sam_local import (
    CHAINS,
    EVENTS,
    EXPECTED,
    FUNCTIONS,
    SUBMITTED_JOB,
    event_names,
    facts,
    load_models,
    seed_jobs_input,
    under_docker,
)
from tests.fakes import eventually
from tests.integration.test_gpu_service import _infer_slow, _wait_queue
from tests.support import link_model, write_slow_model

# The first test pays for the images (minutes on a clean machine) and every invocation.
pytestmark = pytest.mark.timeout(1800)


def _stack_client(stack: LocalStack, service: str) -> Any:
    return boto3.client(service, region_name=REGION, endpoint_url=stack.url("moto"))


def _run_job_children(stack: LocalStack, log_dir: Path) -> list[int]:
    """Each array child of the submitted job, as AWS Batch starts it: the job's command and
    environment in the GPU image, ``AWS_BATCH_JOB_ARRAY_INDEX`` set; their exit codes."""
    job_id = _stack_client(stack, "dynamodb").get_item(
        TableName=JobsSettings().table, Key={"job_id": {"S": SUBMITTED_JOB}}
    )["Item"]["batch_job_id"]["S"]
    job = _stack_client(stack, "batch").describe_jobs(jobs=[job_id])["jobs"][0]
    environment = {e["name"]: e["value"] for e in job["container"].get("environment", [])}
    environment |= stack.aws_env()
    codes = []
    for index in range(job["arrayProperties"]["size"]):
        variables = {
            **environment,
            "AWS_BATCH_JOB_ID": f"{job_id}:{index}",
            "AWS_BATCH_JOB_ATTEMPT": "1",
            "AWS_BATCH_JOB_ARRAY_INDEX": str(index),
        }
        options = ["--network", "host", "--read-only", "--tmpfs", "/tmp"]  # noqa: S108
        options += [arg for name, value in variables.items() for arg in ("-e", f"{name}={value}")]
        child = Container(GPU_IMAGE, *job["container"]["command"], options=tuple(options))
        try:
            code = int(docker("wait", child.id, timeout=300))
            (log_dir / f"child-{index}.log").write_text(child.logs())
        finally:
            child.remove()
        codes.append(code)
    return codes


@dataclass(frozen=True)
class Run:
    """Every event's invocation, and the exit codes of the submitted job's children."""

    invocations: dict[str, Invocation]
    children: list[int]


@pytest.fixture(scope="module")
def run(stack: LocalStack, models_dir: Path) -> Run:
    """Every event under ``sam local invoke``, three at a time (each starts a container);
    the logs go to build/sam-local/logs."""
    require_docker()
    build_images()
    templates = sam_build()
    seed_jobs_input(models_dir, _stack_client(stack, "s3"))
    load_models(stack.url("gpu"))
    log_dir = OUT / "logs"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    children: list[int] = []

    def invoke(name: str) -> Invocation:
        function = next(f for f, folder in FUNCTIONS.items() if name.startswith(f"{folder}/"))
        done = sam_invoke(function, templates[function], EVENTS / name, stack.sam_env_path)
        (log_dir / name.replace("/", "--")).with_suffix(".log").write_text(done.log)
        return done

    def in_order(chain: tuple[str, ...]) -> dict[str, Invocation]:
        """A chain one event after the other; the job submit.json starts has its array
        children run right after it, before its status is asked for."""
        results = {}
        for name in chain:
            results[name] = invoke(name)
            if name == "jobs/submit.json":
                children.extend(_run_job_children(stack, log_dir))
        return results

    chained = {name for chain in CHAINS for name in chain}
    alone = [n for f in FUNCTIONS for n in event_names(f) if n not in chained]
    with ThreadPoolExecutor(3) as pool:
        chains = [pool.submit(in_order, chain) for chain in CHAINS if under_docker(chain[0])]
        results = dict(zip(alone, pool.map(invoke, alone), strict=True))
        for chain in chains:
            results |= chain.result()
    (log_dir / "seconds.json").write_text(json.dumps({n: r.seconds for n, r in results.items()}))
    return Run(results, children)


@pytest.mark.parametrize("name", sorted(filter(under_docker, EXPECTED)))
def test_event_under_sam_local_invoke(run: Run, models_dir: Path, name: str) -> None:
    # GIVEN the event, WHEN `sam local invoke` runs its function in a container
    invocation = run.invocations[name]
    # THEN the function answered, and as expected
    assert invocation.answer is not None, invocation.log
    EXPECTED[name].verify(invocation.answer, facts(models_dir))


def test_the_job_children_ran_in_the_gpu_image(run: Run) -> None:
    # GIVEN the job submit.json started, its two children run in the GPU image, both exit 0
    assert run.children == [0, 0], "logs: build/sam-local/logs/child-*.log"
    # WHEN the status event asks for it after them
    answer = run.invocations["jobs/status-of-submit.json"].answer
    assert answer is not None
    status = answer.body
    # THEN every shard is done, every record scored, none failed
    assert (status["shards_done"], status["shards_total"]) == (2, 2), status
    assert (status["records"], status["errors"]) == (10, 0), status


# --- the GPU service image --------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_container(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Container]:
    """The GPU image with its own command, a read-only root and a model folder mounted:
    digits, and a slow model that holds requests in flight for the drain test."""
    require_docker()
    build_images()
    repo = tmp_path_factory.mktemp("gpu-repo")
    link_model(models_dir, repo, "digits")
    write_slow_model(repo, max_batch_size=1, max_queue_size=3, steps=6)
    for path in [repo, *repo.rglob("*")]:  # readable by the image's user, 10001
        path.chmod(path.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0))
    options = (
        *("--publish", "127.0.0.1::8000", "--read-only", "--tmpfs", "/tmp"),  # noqa: S108
        *("--volume", f"{repo}:/models:ro", "--env", "GPU_REPOSITORY=/models"),
        *("--env", "GPU_INSTANCE_COUNT=1", "--env", "GPU_DRAIN_TIMEOUT_S=60"),
    )
    container = Container(GPU_IMAGE, options=options)
    try:
        yield container
    finally:
        container.remove()


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, json.loads(response.read())


def test_gpu_image_serves_as_non_root_and_reports_healthy(
    gpu_container: Container, models_dir: Path
) -> None:
    # GIVEN the image started with its own command (python -m gpu_service)
    # WHEN its HEALTHCHECK has run
    eventually(
        lambda: gpu_container.inspect("{{.State.Health.Status}}") == "healthy",
        f"the container's health check passes\n{gpu_container.logs()[-3000:]}",
        timeout_s=120,
        interval_s=0.5,
    )
    # THEN it runs as the image's unprivileged user
    assert gpu_container.inspect("{{.Config.User}}") == "10001:10001"
    uid = gpu_container.exec("sh", "-c", "grep ^Uid: /proc/1/status").split()[1:]
    assert set(uid) == {"10001"}
    # AND it serves a real inference on the CPU provider (stated in its log)
    images = np.load(models_dir / "digits/samples/images.npy").astype(np.float32)
    body = {"inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32",
                        "data": images[0].ravel().tolist()}]}  # fmt: skip
    base = f"http://127.0.0.1:{gpu_container.port(8000)}"
    status, answer = _post(f"{base}/v2/models/digits/infer", body)
    label = int(np.load(models_dir / "digits/samples/labels.npy")[0])
    assert (status, answer["outputs"][0]["data"]) == (200, [label])
    assert "CPUExecutionProvider" in gpu_container.logs()


def test_gpu_image_drains_in_flight_requests_on_sigterm(gpu_container: Container) -> None:
    # GIVEN a slow request computing and two queued behind it
    base = f"http://127.0.0.1:{gpu_container.port(8000)}"
    eventually(lambda: gpu_container.inspect("{{.State.Health.Status}}") == "healthy", "healthy")
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(_infer_slow, base, 1.0)
        _wait_queue(base, running=1, queued=0)
        queued = [pool.submit(_infer_slow, base, float(i)) for i in (2, 3)]
        _wait_queue(base, running=1, queued=2)
        # WHEN the container is stopped as ECS stops it (SIGTERM to its command)
        docker("kill", "--signal", str(int(signal.SIGTERM)), gpu_container.id)
        eventually(lambda: "readiness false" in gpu_container.logs(), "the service drains")
        # THEN new work is refused while the admitted requests finish
        try:
            late = _infer_slow(base, 4.0)[0]
        except (urllib.error.URLError, ConnectionError):
            late = -1
        results = [f.result()[0] for f in [first, *queued]]
    exit_code = int(docker("wait", gpu_container.id, timeout=120))
    assert results == [200, 200, 200]
    assert late in (-1, 503)
    # AND the container exits cleanly, not killed
    assert (exit_code, gpu_container.state()["OOMKilled"]) == (0, False)
