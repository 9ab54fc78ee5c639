"""Data capture on real services, on 127.0.0.1: the router over HTTP in front of a GPU
service (digits, and ``scale`` in two versions that answer differently), S3 on the
session's moto server. Two tenants send a 200 (JSON and binary), the backend's 400 (bad
input shape) and the router's 503 (no backend); every record lands in its own tenant's
area with its fields. ``spillway capture list`` reads them back by tenant, model and
status; ``spillway capture replay`` against the live service reproduces the answers
(exit 0) and finds the difference of another version or of an altered record (exit 1).
A writer pointed at an S3 that accepts connections and never answers leaves serving
untouched, and its buffer within its bound, the drops counted."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from spillway.aws.clients import client
from spillway.capture.layout import Area, hour_of
from spillway.capture.watcher import Capture
from spillway.protocol.codec import encode_request
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app
from spillway_cli.local.wsgi_server import running
from spillway_cli.main import app as cli
from spillway_cli.modelbuild.common import write_checksums
from tests.fakes import eventually
from tests.support import Service, gpu_service, link_model

POLICY = """
rules:
  - name: serverless-requested
    match: {mode: [serverless]}
    route: cpu
  - name: default
    route: gpu
capture:
  - {model: "*", sample: 1.0}
"""
AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def write_scale_model(root: Path) -> None:
    """``scale``: ``y = k * x`` with ``k`` its version (1 and 2), both versions served."""
    for version in (1, 2):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])
        k = numpy_helper.from_array(np.array(float(version), np.float32), "k")
        graph = helper.make_graph(
            [helper.make_node("Mul", ["x", "k"], ["y"])], "scale", [x], [y], [k]
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        folder = root / "scale" / str(version)
        folder.mkdir(parents=True)
        onnx.save(model, folder / "model.onnx")
        write_checksums(folder)
    config = {
        "name": "scale",
        "platform": "onnxruntime_onnx",
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
        "version_policy": {"all": {}},
    }
    (root / "scale" / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def capture_gpu(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The module's GPU service: digits and both versions of ``scale``."""
    root = tmp_path_factory.mktemp("capture-repo")
    link_model(models_dir, root, "digits")
    write_scale_model(root)
    with gpu_service(root, tmp_path_factory.mktemp("capture-logs")) as svc:
        yield svc


@pytest.fixture(scope="module")
def aws(moto_endpoint: str) -> Iterator[dict[str, str]]:
    """boto3's variables pointed at the session's moto server, for the module."""
    env = {"AWS_ENDPOINT_URL": moto_endpoint, **AWS}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        patch.delenv("AWS_PROFILE", raising=False)
        yield env


@dataclass
class Stack:
    """The router with capture on, its URL, the GPU service and the capture root."""

    url: str
    gpu: Service
    capture: Capture
    root: str

    def post(self, path: str, body: bytes, tenant: str, **headers: str) -> tuple[int, bytes]:
        sent = {"content-type": "application/json", "x-spillway-tenant": tenant, **headers}
        request = urllib.request.Request(f"{self.url}{path}", body, sent, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


@pytest.fixture(scope="module")
def stack(
    capture_gpu: Service, aws: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    bucket = f"capture-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    folder = tmp_path_factory.mktemp("capture-router")
    (folder / "policy.yaml").write_text(POLICY)
    root = f"s3://{bucket}/capture"
    settings = RouterSettings(
        gpu_url=capture_gpu.base,
        cpu_url=None,
        policy_file=folder / "policy.yaml",
        trust_tenant_hints=True,
        capture_root=root,
        capture_flush_s=3600,  # written when the test says, by flush()
        metrics_log=folder / "metrics.jsonl",
    )
    app = create_app(settings)
    capture = app.router.watch
    assert isinstance(capture, Capture)
    with running(app) as url:
        yield Stack(url, capture_gpu, capture, root)
    capture.close()


def _digits(images: np.ndarray, *, binary: bool = False) -> tuple[bytes, dict[str, str]]:
    body, length = encode_request({"image": images}, binary=binary, binary_outputs=binary)
    if length is None:
        return body, {}
    return body, {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(length),
    }


def _scale(values: list[float]) -> bytes:
    tensor = {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": values}
    return json.dumps({"inputs": [tensor]}).encode()


def _cli(env: dict[str, str], *args: str) -> Any:
    return CliRunner().invoke(cli, ["capture", *args], env=env)


@pytest.fixture(scope="module")
def sent(stack: Stack, models_dir: Path) -> dict[str, list[int]]:
    """The traffic of two tenants, written to S3: what each status was."""
    images = np.load(models_dir / "digits/samples/images.npy")[:2].astype(np.float32)
    json_body, _ = _digits(images)
    binary_body, binary_headers = _digits(images, binary=True)
    bad = json.dumps(
        {"inputs": [{"name": "image", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    ).encode()
    statuses: dict[str, list[int]] = {"acme": [], "globex": []}
    for body, headers in (
        (json_body, {}),
        (binary_body, binary_headers),
        (bad, {}),
        (json_body, {"x-spillway-mode": "serverless"}),
    ):
        status, _ = stack.post("/v2/models/digits/infer", body, "acme", **headers)
        statuses["acme"].append(status)
    status, _ = stack.post("/v2/models/scale/infer", _scale([1.0, 2.0, 3.5, -4.0]), "globex")
    statuses["globex"].append(status)
    assert stack.capture.flush() == 5
    return statuses


def test_records_land_in_each_tenants_own_area_with_their_fields(
    stack: Stack, sent: dict[str, list[int]], aws: dict[str, str]
) -> None:
    assert sent == {"acme": [200, 200, 400, 503], "globex": [200]}
    # THEN every object lies in the area of the tenant whose records it holds
    bucket = stack.root.removeprefix("s3://").split("/")[0]
    s3 = boto3.client("s3")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    areas = {tenant: Area.of(stack.root, tenant) for tenant in ("acme", "globex")}
    for key in keys:
        owner = next(t for t, a in areas.items() if key.startswith(a.prefix))
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        tenants = {json.loads(line)["tenant"] for line in gzip.decompress(body).splitlines()}
        assert tenants == {owner}
        assert key.endswith(".jsonl.gz")
    # AND `spillway capture list` reads acme's back, with every field
    listed = _cli(aws, "list", "--tenant", "acme", "--root", stack.root, "--json")
    assert listed.exit_code == 0, listed.output
    records = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["status"] for r in records] == [200, 200, 400, 503]
    assert {r["tenant"] for r in records} == {"acme"}
    ok, binary, refused, unserved = records
    assert (ok["model"], ok["backend"], ok["version"], ok["rule"]) == (
        "digits",
        "gpu",
        "1",
        "default",
    )
    assert ok["request"]["encoding"] == "json"
    assert ok["response"]["encoding"] == "json"
    assert ok["request_id"]
    assert ok["latency_ms"] > 0
    assert ok["replayable"]
    assert len(ok["trace_id"] or "0" * 32) == 32
    assert binary["request"]["encoding"] == "base64"
    assert binary["request"]["header_length"] > 0
    assert binary["response"]["header_length"] > 0
    assert refused["backend"] == "gpu"
    assert refused["error"]["code"] == "invalid_input"
    assert unserved["backend"] is None
    assert unserved["error"]["code"] == "unavailable"
    assert unserved["rule"] == "serverless-requested"


def test_list_filters_by_status_model_and_tenant(
    stack: Stack, sent: dict[str, list[int]], aws: dict[str, str]
) -> None:
    def statuses(*args: str) -> list[int]:
        done = _cli(aws, "list", "--root", stack.root, "--json", *args)
        assert done.exit_code == 0, done.output
        return [json.loads(line)["status"] for line in done.stdout.splitlines()]

    assert statuses("--tenant", "acme", "--status", "5xx") == [503]
    assert statuses("--tenant", "acme", "--status", "200") == [200, 200]
    assert statuses("--tenant", "acme", "--status", "error") == [400, 503]
    assert statuses("--tenant", "acme", "--model", "scale") == []
    assert statuses("--tenant", "acme", "--since", "1h", "--limit", "1") == [503]
    assert statuses("--tenant", "acme", "--until", "2000-01-01T00:00") == []
    assert statuses("--tenant", "globex") == [200]
    assert statuses() == []  # the anonymous tenant has none
    table = _cli(aws, "list", "--tenant", "acme", "--root", stack.root)
    assert table.exit_code == 0
    assert "STATUS" in table.stdout
    assert "unavailable" in table.stdout


def test_replay_reproduces_the_answers_of_the_live_service(
    stack: Stack, sent: dict[str, list[int]], aws: dict[str, str]
) -> None:
    # WHEN acme's records are replayed against the GPU service and through the router
    for to in (stack.gpu.base, stack.url):
        done = _cli(aws, "replay", "--tenant", "acme", "--root", stack.root, "--to", to,
                    "--header", "x-spillway-tenant: replay")  # fmt: skip
        # THEN the 200s and the 400 match, the 503 is not replayable, and it exits 0
        assert done.exit_code == 0, done.output
        assert "3 matched, 0 differed, 1 not replayable, 0 failed" in done.stdout


def test_replay_finds_the_difference_of_another_version(
    stack: Stack, sent: dict[str, list[int]], aws: dict[str, str]
) -> None:
    args = ["replay", "--tenant", "globex", "--root", stack.root, "--to", stack.gpu.base]
    # GIVEN globex's request, answered by scale's newest version (2: y = 2x)
    listed = _cli(aws, "list", "--tenant", "globex", "--root", stack.root, "--json")
    assert json.loads(listed.stdout)["version"] == "2"
    # WHEN it is replayed to version 2 THEN it matches; to version 1 (y = x) it differs
    same = _cli(aws, *args, "--version", "2")
    assert same.exit_code == 0, same.output
    other = _cli(aws, *args, "--version", "1", "--json")
    assert other.exit_code == 1, other.output
    report = json.loads(other.stdout)
    assert report["counts"]["differed"] == 1
    assert "'y'" in report["results"][0]["reason"]


def test_replay_finds_an_altered_record(
    stack: Stack, sent: dict[str, list[int]], aws: dict[str, str]
) -> None:
    # GIVEN globex's record with one output value changed, as another tenant's capture
    listed = _cli(aws, "list", "--tenant", "globex", "--root", stack.root, "--json")
    record = json.loads(listed.stdout.splitlines()[0])
    record["tenant"] = "initech"
    record["response"]["data"]["outputs"][0]["data"][0] += 0.5
    where = Area.of(stack.root, "initech")
    hour = hour_of(datetime.fromisoformat(record["time"].replace("Z", "+00:00")))
    key = f"{where.model_prefix('scale')}{hour}/20000101T000000Z-altered.jsonl.gz"
    body = gzip.compress(json.dumps(record).encode() + b"\n")
    boto3.client("s3").put_object(Bucket=where.bucket, Key=key, Body=body)
    # WHEN it is replayed THEN the difference is found
    done = _cli(aws, "replay", "--tenant", "initech", "--root", stack.root, "--to", stack.gpu.base)
    assert done.exit_code == 1, done.output
    assert "0 matched, 1 differed" in done.stdout
    assert "'y': 1 of 4 values beyond" in done.stdout


# --- a stalled S3 ----------------------------------------------------------------------


@pytest.fixture
def stalled_s3() -> Iterator[str]:
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for connection in held:
        connection.close()
    listener.close()


def test_a_stalled_s3_leaves_serving_untouched_and_the_buffer_bounded(
    capture_gpu: Service, stalled_s3: str, aws: dict[str, str], tmp_path: Path
) -> None:
    # GIVEN a router whose capture writes to an S3 that never answers (1 s timeouts), a
    # 64 KiB buffer and batches due after 50 ms
    (tmp_path / "policy.yaml").write_text(POLICY)
    settings = RouterSettings(
        gpu_url=capture_gpu.base,
        policy_file=tmp_path / "policy.yaml",
        trust_tenant_hints=True,
        capture_root="s3://stalled/capture",
        capture_buffer_bytes=64 * 1024,
        capture_max_record_bytes=16 * 1024,
        capture_flush_s=0.05,
        metrics_log=tmp_path / "metrics.jsonl",
    )
    s3 = client("s3", endpoint_url=stalled_s3, connect_timeout=1, read_timeout=1, max_attempts=1)
    app = create_app(settings, Overrides(capture_s3=s3))
    capture = app.router.watch
    assert isinstance(capture, Capture)
    body = _scale([1.0, 2.0, 3.0, 4.0]) + b" " * 3000  # about 3 kB a record
    try:
        with running(app) as url:
            server = Stack(url, capture_gpu, capture, settings.capture_root or "")
            # WHEN 150 requests are sent
            slowest, statuses = 0.0, []
            for _ in range(150):
                started = time.monotonic()
                status, _ = server.post("/v2/models/scale/infer", body, "acme")
                slowest = max(slowest, time.monotonic() - started)
                statuses.append(status)
                assert capture.buffer.bytes <= capture.buffer.max_bytes
            # THEN every request is answered, none waits on S3, and the drops are counted
            assert statuses == [200] * 150
            assert slowest < 0.9, f"a request took {slowest:.2f} s: it waited on S3"
            assert capture.buffer.dropped > 0
            assert capture.writer.objects == 0
            assert capture.buffer.accepted + capture.buffer.dropped == 150
            # AND every drop is counted once in CaptureDropped metric lines
            capture.writer.report_drops()
            eventually(
                lambda: _reported_drops(tmp_path / "metrics.jsonl") == capture.buffer.dropped,
                "the drops reported as CaptureDropped",
                timeout_s=10,
            )
    finally:
        capture.close(timeout_s=5, write=False)  # S3 never answers: nothing to write


def _reported_drops(metrics: Path) -> int:
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return int(sum(sum(doc["CaptureDropped"]) for doc in lines if "CaptureDropped" in doc))
