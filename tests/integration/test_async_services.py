"""Async inference end to end on 127.0.0.1: the router accepts (202), the real GPU service
consumes the queue (moto's SQS, S3, DynamoDB), and when the GPU service is killed
halfway the CPU fallback drains what is left. Every request ends with exactly one
result, equal to the synchronous answer for the same input; a poison message lands in
the dead-letter queue with its error recorded; the demo's async section, which names
one input in the caller's own area, passes against the same services."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from werkzeug.test import Client, TestResponse

from spillway.async_inference.store import AsyncStore
from spillway.aws.clients import aws_client
from spillway.fallback.async_drain import drain_forever
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway_cli.demo.async_requests import scenario_async
from spillway_cli.local.async_resources import async_env, create_async_resources
from spillway_cli.local.wsgi_server import running
from tests.fakes import eventually
from tests.support import gpu_service

REQUESTS = 200


def _body(image: np.ndarray, **parameters: Any) -> dict[str, Any]:
    tensor = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32",
              "data": image.ravel().tolist()}  # fmt: skip
    return {"inputs": [tensor], "parameters": parameters} if parameters else {"inputs": [tensor]}


def _label(answer: bytes) -> Any:
    outputs = {o["name"]: o["data"] for o in json.loads(answer)["outputs"]}
    return outputs["label"]


def test_every_async_request_gets_one_result_across_a_gpu_kill(
    aws_env: str,
    serving_repo: Path,
    models_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GIVEN the async resources, and the router and the GPU service configured for them
    suffix = uuid.uuid4().hex[:8]
    settings = create_async_resources(
        f"async-{suffix}", lease_s=4, drain_age_s=2.0,
        names=(f"t-{suffix}", f"q-{suffix}", f"dlq-{suffix}"),
    )  # fmt: skip
    for key, value in async_env(settings).items():
        monkeypatch.setenv(key, value)
    images = np.load(models_dir / "digits" / "samples" / "images.npy").astype(np.float32)
    stop_drain = threading.Event()
    with gpu_service(serving_repo, tmp_path / "logs") as gpu:
        router = Client(
            create_app(
                RouterSettings(gpu_url=gpu.base, metrics_log=tmp_path / "metrics.log"),
            )
        )
        # the synchronous answers, through the same router and GPU service
        sync = []
        for i in range(REQUESTS):
            answer = router.post("/v2/models/digits/infer", json=_body(images[i % len(images)]))
            assert answer.status_code == 200
            sync.append(_label(answer.data))
        # WHEN 200 requests are sent async (the three ways of asking for it)
        ids = []
        for i in range(REQUESTS):
            image = images[i % len(images)]
            if i % 3 == 0:
                answer = router.post("/v2/models/digits/infer", json=_body(image, mode="async"))
            elif i % 3 == 1:
                answer = router.post("/v2/models/digits/infer", json=_body(image),
                                     headers={"x-spillway-mode": "async"})  # fmt: skip
            else:
                answer = router.post("/v2/models/digits/infer", json=_body(image),
                                     headers={"prefer": "respond-async"})  # fmt: skip
            assert answer.status_code == 202, answer.data
            accepted = json.loads(answer.data)
            assert answer.headers["location"] == f"/v1/results/{accepted['id']}"
            ids.append(accepted["id"])

        def finished() -> list[int]:
            return [
                i
                for i, rid in enumerate(ids)
                if router.get(f"/v1/results/{rid}").status_code == 200
            ]

        # AND the GPU service is killed once about half have their result
        eventually(lambda: len(finished()) >= REQUESTS // 2, "half the results", timeout_s=120)
        gpu.child.proc.kill()
        gpu.child.proc.wait(30)
    # THEN the CPU fallback drains the rest (the oldest waits past the drain age)
    cpu = CpuService.load(CpuSettings(repository=str(serving_repo), models=["digits"]))
    store = AsyncStore(settings)
    drain = threading.Thread(target=drain_forever, args=(cpu, store, stop_drain, 0.2))
    drain.start()
    try:
        eventually(lambda: len(finished()) == REQUESTS, "every result", timeout_s=180)
    finally:
        stop_drain.set()
        drain.join(30)
    # AND every result equals the synchronous answer, and no message is left over
    for i, rid in enumerate(ids):
        reply = router.get(f"/v1/results/{rid}")
        assert reply.status_code == 200
        assert _label(reply.data) == sync[i], i
    sqs = aws_client("sqs")
    for url in (
        settings.queue_url,
        str(settings.queue_url).replace(f"q-{suffix}", f"dlq-{suffix}"),
    ):
        counts = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
        assert counts["ApproximateNumberOfMessages"] == "0"
        assert counts["ApproximateNumberOfMessagesNotVisible"] == "0"


def test_a_poison_request_is_dead_lettered_with_its_error(
    aws_env: str, serving_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a request whose staged input disappears (the consumer cannot read it)
    suffix = uuid.uuid4().hex[:8]
    settings = create_async_resources(
        f"async-{suffix}", lease_s=1, drain_age_s=0.0, max_attempts=2,
        names=(f"t-{suffix}", f"q-{suffix}", f"dlq-{suffix}"),
    )  # fmt: skip
    for key, value in async_env(settings).items():
        monkeypatch.setenv(key, value)
    router = Client(create_app(RouterSettings(gpu_url=None, metrics_log=tmp_path / "m.log")))
    answer = router.post("/v2/models/digits/infer", json=_body(np.zeros((8, 8)), mode="async"))
    rid = json.loads(answer.data)["id"]
    store = AsyncStore(settings)
    location = store.location
    store.client("s3").delete_object(Bucket=location.bucket, Key=location.key(rid, "request.v2req"))
    # WHEN the CPU fallback drains the queue
    cpu = CpuService.load(CpuSettings(repository=str(serving_repo), models=["digits"]))
    stop = threading.Event()
    drain = threading.Thread(target=drain_forever, args=(cpu, store, stop, 0.1))
    drain.start()
    try:

        def failed() -> TestResponse | None:
            answer = router.get(f"/v1/results/{rid}")
            return answer if answer.status_code != 202 else None

        reply = eventually(failed, "the request to fail", timeout_s=60)
        dlq = str(settings.queue_url).replace(f"q-{suffix}", f"dlq-{suffix}")
        eventually(
            lambda: (
                aws_client("sqs").receive_message(QueueUrl=dlq, WaitTimeSeconds=0).get("Messages")
            ),
            "the message in the dead-letter queue",
            timeout_s=30,
        )
    finally:
        stop.set()
        drain.join(30)
    # THEN it failed after its attempts, as a server fault with its error recorded
    assert reply.status_code == 500
    body = json.loads(reply.data)
    assert body["code"] == "internal"
    record = store.find(rid)
    assert record is not None
    assert (record.attempts, record.code) == (2, "internal")


def test_the_demos_async_section_names_an_input_in_its_area(
    aws_env: str,
    serving_repo: Path,
    models_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GIVEN the router on 127.0.0.1 and the GPU service consuming the queue
    suffix = uuid.uuid4().hex[:8]
    settings = create_async_resources(
        f"async-{suffix}", names=(f"t-{suffix}", f"q-{suffix}", f"dlq-{suffix}")
    )
    for key, value in async_env(settings).items():
        monkeypatch.setenv(key, value)
    said: list[str] = []
    with gpu_service(serving_repo, tmp_path / "logs") as gpu:
        app = create_app(RouterSettings(gpu_url=gpu.base, metrics_log=tmp_path / "m.log"))
        with running(app) as url:
            # WHEN the demo's async section runs against it
            report = scenario_async(
                int(url.rsplit(":", 1)[1]), {}, models_dir, said.append, timeout_s=90
            )
    # THEN every request, the one named by input_location in the caller's area included,
    # was accepted, finished and equal to its synchronous answer
    assert report.ok, report
    assert f"{settings.location}/inputs/-/" in said[0]
    listed = aws_client("s3").list_objects_v2(
        Bucket=f"async-{suffix}", Prefix="async/inputs/-/demo/"
    )
    assert listed["KeyCount"] == 1
