"""The demo's scenarios as assertions against the running local stack."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton

from spillway.aws.clients import aws_client
from spillway_cli.demo.client import Client, under_load
from spillway_cli.local.names import DATA_BUCKET, LOCAL_API_KEY, REGION
from spillway_cli.local.stack import LocalStack
from tests.fakes import eventually
from tests.support import load_engine


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> Client:
    return Client(stack.ports.router)


def test_digits_through_the_router_on_the_gpu_tier(client: Client, models_dir: Path) -> None:
    images = np.load(models_dir / "digits/samples/images.npy").astype(np.float32)
    labels = np.load(models_dir / "digits/samples/labels.npy")
    predicted = []
    for start in range(0, len(images), 32):
        status, headers, out = client.infer(
            "e2e-digits", "digits", {"image": images[start : start + 32]}
        )
        assert (status, headers["x-spillway-backend"]) == (200, "gpu")
        predicted.append(out["label"][:, 0])
    assert (np.concatenate(predicted) == labels).mean() >= 0.95


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_through_the_router(stack: LocalStack, models_dir: Path, binary: bool) -> None:
    texts = np.array([[b"the router forwards this"], [b"and this one too"]], dtype=np.object_)
    tc = triton.InferenceServerClient(f"127.0.0.1:{stack.ports.router}")
    tensor = triton.InferInput("text", [2, 1], "BYTES")
    tensor.set_data_from_numpy(texts, binary_data=binary)
    result = tc.infer(
        "minilm", [tensor], outputs=[triton.InferRequestedOutput("embedding", binary_data=binary)]
    )
    direct = load_engine(models_dir, "minilm").infer({"text": texts})["embedding"]
    np.testing.assert_allclose(result.as_numpy("embedding"), direct, atol=1e-5)
    assert tc.get_model_metadata("digits")["inputs"][0]["shape"] == [-1, 8, 8]


def test_serverless_mode_is_served_by_the_cpu_fallback(client: Client, models_dir: Path) -> None:
    image = np.load(models_dir / "digits/samples/images.npy")[:1].astype(np.float32)
    status, headers, out = client.infer(
        "e2e-cpu", "digits", {"image": image}, {"x-spillway-mode": "serverless"}
    )
    assert (status, headers["x-spillway-backend"]) == (200, "cpu")
    assert float(headers["x-spillway-cost-usd"]) > 0
    direct = load_engine(models_dir, "digits").infer({"image": image})
    np.testing.assert_array_equal(out["label"], direct["label"])


def test_batch_job_over_s3(stack: LocalStack, models_dir: Path) -> None:
    images = np.load(models_dir / "digits/samples/images.npy")[:40]
    s3 = aws_client("s3", REGION)
    lines = [
        json.dumps({"id": f"r{i}", "data": {"image": img.tolist()}}) for i, img in enumerate(images)
    ]
    lines.insert(7, "{not json")
    s3.put_object(Bucket=DATA_BUCKET, Key="e2e/in/part-0.jsonl", Body="\n".join(lines).encode())
    argv = [
        sys.executable,
        "-m",
        "spillway_cli.main",
        "jobs",
        "submit",
        "--model",
        "digits",
        "--input",
        f"s3://{DATA_BUCKET}/e2e/in/",
        "--output",
        f"s3://{DATA_BUCKET}/e2e/out/",
        "--local",
        "--wait",
    ]
    env = {**os.environ, **stack.aws_env(), **stack.jobs_env()}
    subprocess.run(argv, check=True, env=env, capture_output=True, timeout=300)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix="e2e/out/")["Contents"]]
    out_key = next(k for k in keys if k.endswith("part-00000.jsonl"))
    err_key = next(k for k in keys if k.endswith("part-00000.errors.jsonl"))
    outputs = s3.get_object(Bucket=DATA_BUCKET, Key=out_key)["Body"].read().splitlines()
    errors = s3.get_object(Bucket=DATA_BUCKET, Key=err_key)["Body"].read().splitlines()
    assert len(outputs) == 40
    assert len(errors) == 1
    direct = load_engine(models_dir, "digits").infer({"image": images.astype(np.float32)})
    got = [np.ravel(json.loads(line)["outputs"]["label"])[0] for line in outputs]
    assert got == direct["label"][:, 0].tolist()


def test_gpu_killed_under_load_fails_nothing(stack: LocalStack, client: Client) -> None:
    records = under_load(client, "e2e-kill", 400, 8, lambda: stack.children["gpu"].signal(9))
    assert len(records) == 400
    assert [r for r in records if r.status != 200] == []
    assert any(r.backend == "cpu" and r.fallback for r in records)
    stack.children.pop("gpu").proc.wait(10)
    stack.start_gpu()


def test_batch_mode_through_the_router_runs_a_job(stack: LocalStack, models_dir: Path) -> None:
    images = np.load(models_dir / "digits/samples/images.npy")[:6].astype(np.float32)
    client = Client(stack.ports.router)
    # WHEN a request asks for batch mode
    status, headers, raw = client.infer(
        "e2e-batch", "digits", {"image": images}, {"x-spillway-mode": "batch"}
    )
    # THEN it is accepted as a job, and the job runs to completion
    assert (status, headers["x-spillway-backend"]) == (202, "batch")
    job_id = json.loads(raw)["job_id"]

    def finished() -> dict[str, object] | None:
        conn = http.client.HTTPConnection("127.0.0.1", stack.ports.jobs, timeout=30)
        try:
            conn.request("GET", f"/v1/jobs/{job_id}")
            state: dict[str, object] = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        # moto reports the Batch job done at once; the shard markers tell when it is.
        return state if state.get("state") in ("SUCCEEDED", "FAILED") else None

    state = eventually(finished, f"job {job_id} finishes", timeout_s=180, interval_s=0.5)
    assert state.get("state") == "SUCCEEDED", state
    assert state.get("records") == 6
    assert state.get("errors") == 0
    # AND the job is the router's (anonymous) caller's alone: the local API key's tenant
    # gets the 404 of a job that does not exist
    conn = http.client.HTTPConnection("127.0.0.1", stack.ports.jobs, timeout=30)
    try:
        conn.request("GET", f"/v1/jobs/{job_id}", headers={"x-api-key": LOCAL_API_KEY})
        other = conn.getresponse()
        assert (other.status, json.loads(other.read())["code"]) == (404, "job_not_found")
    finally:
        conn.close()
