# ruff: noqa: E501 - the held-out sentences read best one a line
"""Pipelines served everywhere: the GPU service, the CPU fallback, the router and a job.

A repository with ``minilm``, ``topics-head`` and the ``topics`` pipeline (as ``make
models`` builds them), plus, written here, a ``review-head`` model, a ``moderation``
pipeline whose last step only runs for texts the topics head flags, and two broken
pipelines. The pipeline's answers are compared with the step models called one after
the other by hand through the same transport.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from batch_job.plan import RunSpec
from batch_job.runner import run_job
from batch_job.settings import JobsSettings
from spillway.aws.clients import aws_client
from spillway.fallback.app import CpuApp
from spillway.fallback.chain import ServerFault, handle_chain_event
from spillway.fallback.direct import handle_direct
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.processing import Tensors
from spillway.models.repository import LocalRepository
from spillway.pipelines.chain import ChainStore
from spillway.pipelines.stepcache import CacheSettings, SharedCache
from spillway.protocol.codec import decode_response, encode_request
from spillway.protocol.messages import read_staged_request, stage_request
from spillway.protocol.s3urls import parse_s3_url
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway.tenancy.proof import KeyRing, ScopeProofs, StaticKeys
from spillway_cli.demo.pipelines import scenario_topics
from spillway_cli.local.states import LocalStateMachine, substituted
from spillway_cli.local.wsgi_server import running
from spillway_cli.modelbuild.common import write_checksums
from spillway_cli.modelbuild.topics import build_topics
from spillway_cli.statemachines import definition_path, substitutions
from tests.support import Service, gpu_service, link_model, scope_proof_key

# Written by hand for this test; none of them is among the label descriptions the head
# was built from.
HELD_OUT = [
    ("The puppy chewed my slippers again this morning.", "animals"),
    ("Elephants travel many miles to find water during the dry season.", "animals"),
    ("Our cat refuses to eat anything but tuna.", "animals"),
    ("The zoo welcomed a baby giraffe last week.", "animals"),
    ("Owls hunt mostly at night and can turn their heads very far.", "animals"),
    ("Bees are disappearing and farmers worry about pollination.", "animals"),
    ("I took the hamster to the vet because it stopped running on its wheel.", "animals"),
    ("A family of otters was spotted near the river mouth.", "animals"),
    ("The central bank raised rates by a quarter point.", "finance"),
    ("Shares of the retailer fell eight percent after weak earnings.", "finance"),
    ("I'm trying to pay off my credit card debt before the end of the year.", "finance"),
    ("Should I put my savings into an index fund or a bond?", "finance"),
    ("The mortgage payment went up again this month.", "finance"),
    ("Inflation ate into household budgets across the country.", "finance"),
    ("The startup raised forty million dollars in its series B round.", "finance"),
    ("Our quarterly tax bill was higher than we expected.", "finance"),
    ("The striker scored twice in the second half to win the cup.", "sports"),
    ("She broke the world record in the 400 metres.", "sports"),
    ("The Lakers lost in overtime last night.", "sports"),
    ("He has been training for the Boston marathon all winter.", "sports"),
    ("The tennis final went to five sets.", "sports"),
    ("Our local team was promoted to the first division.", "sports"),
    ("The referee sent off two players before half time.", "sports"),
    ("The cyclists climbed the mountain stage in heavy rain.", "sports"),
    ("The new phone has a faster processor and a better camera.", "technology"),
    ("Update your browser to fix the security bug.", "technology"),
    ("We moved our servers to the cloud and cut latency in half.", "technology"),
    ("The compiler crashes when I enable link-time optimisation.", "technology"),
    ("Engineers trained a neural network to translate speech in real time.", "technology"),
    ("My laptop battery drains quickly since the last operating system update.", "technology"),
    ("The app keeps logging me out after the latest release.", "technology"),
    ("The database migration failed halfway through the night.", "technology"),
    ("Drinking enough water helps prevent headaches.", "health"),
    ("The clinic is offering free flu shots this week.", "health"),
    ("My doctor says my blood pressure is too high.", "health"),
    ("Getting eight hours of sleep improves memory and mood.", "health"),
    ("The patient recovered well after knee surgery.", "health"),
    ("Researchers found a link between sugar and heart disease.", "health"),
    ("Therapy helped me cope with anxiety.", "health"),
    ("A daily walk lowers the risk of diabetes.", "health"),
    ("I will find where you live and make you pay.", "needs-review"),
    ("Click this link and enter your bank password to claim your prize.", "needs-review"),
    ("People like you are worthless and should disappear.", "needs-review"),
    ("Where can I buy an untraceable gun without a background check?", "needs-review"),
    ("You're an idiot and everyone hates you.", "needs-review"),
    ("Send me your login details or your account will be deleted today.", "needs-review"),
    ("I know how to make a bomb and I'm going to use it.", "needs-review"),
    ("Selling pills without a prescription, message me.", "needs-review"),
]
MIN_ACCURACY = 0.8
REVIEW = 5  # the needs-review column of the scores
BENIGN = "The tennis final went to five sets."
HOSTILE = "People like you are worthless and should disappear."


def texts(*items: str) -> Tensors:
    return {"text": np.array([[t.encode()] for t in items], dtype=np.object_)}


def labels(outputs: Tensors) -> list[str]:
    return [x.decode() if isinstance(x, bytes) else str(x) for x in outputs["label"][:, 0]]


# --- the repository -----------------------------------------------------------------------


def write_model(root: Path, name: str, model: onnx.ModelProto, config: dict[str, Any]) -> None:
    (root / name / "1").mkdir(parents=True)
    onnx.save(model, root / name / "1" / "model.onnx")
    write_checksums(root / name / "1")
    (root / name / "config.json").write_text(json.dumps({"name": name, **config}))


def write_pipeline(
    root: Path, name: str, steps: list[dict[str, Any]], outputs: list[dict[str, Any]]
) -> None:
    (root / name / "1").mkdir(parents=True)
    write_checksums(root / name / "1")
    config = {
        "name": name,
        "platform": "ensemble",
        "max_batch_size": 64,
        "input": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": outputs,
        "ensemble_scheduling": {"step": steps},
    }
    (root / name / "config.json").write_text(json.dumps(config))


def review_head() -> onnx.ModelProto:
    """``peak`` = the largest component of the embedding: a stand-in second opinion."""
    embedding = helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", 384])
    peak = helper.make_tensor_value_info("peak", TensorProto.FLOAT, ["batch", 1])
    node = helper.make_node("ReduceMax", ["embedding"], ["peak"], axes=[1], keepdims=1)
    graph = helper.make_graph([node], "review", [embedding], [peak])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


EMBED = {
    "model_name": "minilm",
    "input_map": {"text": "text"},
    "output_map": {"embedding": "embedding"},
}
LABEL = {"name": "label", "data_type": "TYPE_STRING", "dims": [1]}
SCORES = {"name": "scores", "data_type": "TYPE_FP32", "dims": [6]}


@pytest.fixture(scope="module")
def repo(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pipelines-repo")
    for name in ("minilm", "topics-head", "topics"):
        link_model(models_dir, root, name)
    vector = {"name": "embedding", "data_type": "TYPE_FP32", "dims": [384]}
    write_model(
        root,
        "review-head",
        review_head(),
        {
            "max_batch_size": 64,
            "input": [vector],
            "output": [{"name": "peak", "data_type": "TYPE_FP32", "dims": [1]}],
        },
    )
    classify = {
        "model_name": "topics-head",
        "input_map": {"embedding": "embedding"},
        "output_map": {"label": "label", "scores": "scores"},
    }
    review = {
        "model_name": "review-head",
        "input_map": {"embedding": "embedding"},
        "output_map": {"peak": "peak"},
        "spillway": {
            "condition": {"tensor": "scores", "element": REVIEW, "op": ">=", "value": 0.5}
        },
    }
    write_pipeline(
        root,
        "moderation",
        [EMBED, classify, review],
        [LABEL, SCORES, {"name": "peak", "data_type": "TYPE_FP32", "dims": [1]}],
    )
    write_pipeline(root, "broken", [{**EMBED, "model_name": "nosuch"}], [vector])
    tangled = {
        "model_name": "topics-head",
        "input_map": {"embedding": "text"},
        "output_map": {"label": "label"},
    }
    write_pipeline(root, "tangled", [tangled], [LABEL])
    return root


@pytest.fixture(scope="module")
def sign(moto_endpoint: str) -> Iterator[Callable[[str], str]]:
    """The router's signer of tenant scopes; the GPU service verifies with its key."""
    with scope_proof_key(moto_endpoint) as signer:
        yield signer


@pytest.fixture
def signed(sign: Callable[[str], str]) -> dict[str, str]:
    """The header the router sends for an anonymous caller (its step cache is used only
    with the router's proof, valid for minutes: signed per test)."""
    return {"x-spillway-tenant-scope": sign("-")}


@pytest.fixture(scope="module")
def gpu(
    repo: Path, tmp_path_factory: pytest.TempPathFactory, sign: Callable[[str], str]
) -> Iterator[Service]:
    logs = tmp_path_factory.mktemp("pipelines-logs")
    # The broken pipelines keep the service from being ready, as a broken model would.
    with gpu_service(repo, logs, "/v2/models/topics/ready", model_control_mode="explicit") as svc:
        yield svc


@pytest.fixture(scope="module")
def cpu(repo: Path) -> CpuService:
    return CpuService.load(CpuSettings(repository=str(repo)))


@pytest.fixture(scope="module")
def bases(gpu: Service, cpu: CpuService) -> Iterator[dict[str, str]]:
    settings = RouterSettings(gpu_url=gpu.base, metrics_log=Path("/dev/null"))
    with running(CpuApp(cpu)) as cpu_url, running(create_app(settings)) as router_url:
        yield {"gpu": gpu.base, "cpu": cpu_url, "router": router_url}


# --- calling ------------------------------------------------------------------------------


def call(
    base: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(
        base + path, body, headers or {}, method="GET" if body is None else "POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return (
                response.status,
                {k.lower(): v for k, v in response.headers.items()},
                response.read(),
            )
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def infer(
    base: str,
    model: str,
    inputs: Tensors,
    *,
    binary: bool = False,
    scope: dict[str, str] | None = None,
) -> tuple[dict[str, Any], Tensors]:
    """The response header (as JSON) and outputs of one infer request (``scope``: the
    tenant scope header the router would send)."""
    body, length = encode_request(inputs, binary=binary, binary_outputs=binary)
    headers = {} if length is None else {"inference-header-content-length": str(length)}
    headers.update(scope or {})
    status, answer_headers, data = call(base, f"/v2/models/{model}/infer", body, headers)
    assert status == 200, data[:300]
    out_length = answer_headers.get("inference-header-content-length")
    response, outputs = decode_response(data, None if out_length is None else int(out_length))
    return response.model_dump(exclude_none=True), outputs


def by_hand(base: str, inputs: Tensors, binary: bool) -> Tensors:
    """minilm, then topics-head with its embedding: the pipeline's steps one by one."""
    _, embedded = infer(base, "minilm", inputs, binary=binary)
    return infer(base, "topics-head", {"embedding": embedded["embedding"]}, binary=binary)[1]


def model_stats(base: str, model: str) -> dict[str, Any]:
    status, _, body = call(base, f"/v2/models/{model}/stats")
    assert status == 200
    entry: dict[str, Any] = json.loads(body)["model_stats"][0]
    return entry


# --- the tests ----------------------------------------------------------------------------


def test_topics_classifies_held_out_sentences(gpu: Service) -> None:
    # GIVEN sentences written by hand, none of them a label description
    assert len(HELD_OUT) >= 40
    assert {label for _, label in HELD_OUT} >= {
        "animals",
        "finance",
        "sports",
        "technology",
        "health",
        "needs-review",
    }
    # WHEN the GPU service classifies them in one batched request
    _, outputs = infer(gpu.base, "topics", texts(*(t for t, _ in HELD_OUT)))
    # THEN most come back with their topic
    accuracy = float(np.mean([p == y for p, (_, y) in zip(labels(outputs), HELD_OUT, strict=True)]))
    print(f"topics held-out accuracy: {accuracy:.3f} over {len(HELD_OUT)} sentences")
    assert accuracy >= MIN_ACCURACY
    np.testing.assert_allclose(outputs["scores"].sum(axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("transport", ["gpu", "cpu", "router"])
def test_the_pipeline_equals_its_steps_by_hand(
    bases: dict[str, str], transport: str, binary: bool
) -> None:
    base = bases[transport]
    for request in (texts(HOSTILE), texts(*(t for t, _ in HELD_OUT[::6]))):  # single, batched
        # WHEN the pipeline and its steps one by one answer the same texts
        header, outputs = infer(base, "topics", request, binary=binary)
        reference = by_hand(base, request, binary)
        # THEN they agree (batching may pad a row differently: 1e-5)
        assert (header["model_name"], header["model_version"]) == ("topics", "1")
        assert labels(outputs) == labels(reference)
        np.testing.assert_allclose(outputs["scores"], reference["scores"], atol=1e-5)
        assert outputs["scores"].shape == (len(request["text"]), 6)


def test_the_demo_section_classifies_through_the_router(bases: dict[str, str]) -> None:
    lines: list[str] = []
    port = int(bases["router"].rsplit(":", 1)[1])
    report = scenario_topics(port, {}, lines.append)
    assert report.ok, lines
    assert report.correct >= 5
    assert "[gpu" in lines[1]


def test_the_cpu_fallback_direct_invoke_serves_the_pipeline(cpu: CpuService) -> None:
    body, _ = encode_request(texts(BENIGN), binary=False)
    answer = handle_direct(cpu, {"model": "topics", "body_b64": base64.b64encode(body).decode()})
    assert answer["statusCode"] == 200
    response = json.loads(answer["body"])
    assert [o["data"] for o in response["outputs"] if o["name"] == "label"] == [["sports"]]
    ready = handle_direct(cpu, {"model": "topics", "operation": "ready"})
    assert ready["statusCode"] == 200


def test_a_batch_job_runs_the_pipeline(cpu: CpuService, repo: Path, tmp_path: Path) -> None:
    # GIVEN JSON Lines records, one of them an empty text
    sentences = [t for t, _ in HELD_OUT[:12]]
    lines = [json.dumps({"id": f"r{i}", "data": {"text": t}}) for i, t in enumerate(sentences)]
    lines.insert(3, json.dumps({"id": "empty", "data": {"text": "  "}}))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "texts.jsonl").write_text("\n".join(lines) + "\n")
    settings = JobsSettings(
        repository=str(repo), providers=("CPUExecutionProvider",), progress_bar=False
    )
    # WHEN the job runs over the pipeline in batches of 5
    spec = RunSpec("topics", str(tmp_path / "in"), str(tmp_path / "out"), batch_size=5)
    result = run_job(spec, settings)
    # THEN every good record has the answer of the steps run by hand; the bad one is an error
    assert (result.committed, result.failed) == (["part-00000"], {})
    outputs = [
        json.loads(x) for x in (tmp_path / "out" / "part-00000.jsonl").read_text().splitlines()
    ]
    assert [o["id"] for o in outputs] == [f"r{i}" for i in range(12)]
    embedded = cpu.get("minilm", None).infer(texts(*sentences))["embedding"]
    reference = cpu.get("topics-head", None).infer({"embedding": embedded})
    assert [o["outputs"]["label"][0] for o in outputs] == labels(reference)
    np.testing.assert_allclose(
        [o["outputs"]["scores"] for o in outputs], reference["scores"], atol=1e-5
    )
    errors = [
        json.loads(x)
        for x in (tmp_path / "out" / "part-00000.errors.jsonl").read_text().splitlines()
    ]
    assert [(e["id"], e["code"]) for e in errors] == [("empty", "invalid_input")]


def test_concurrent_pipeline_requests_batch_the_embedding_step(gpu: Service) -> None:
    # GIVEN 32 clients, each sending 4 texts of its own (no two alike: no cache hits)
    before = model_stats(gpu.base, "minilm")
    failures: list[str] = []

    def client(number: int) -> None:
        for round_ in range(4):
            text = f"Client {number} asks question {round_}: how did the match end?"
            try:
                infer(gpu.base, "topics", texts(text))
            except AssertionError as error:
                failures.append(str(error))

    # WHEN they all run at once
    threads = [threading.Thread(target=client, args=(n,)) for n in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    after = model_stats(gpu.base, "minilm")
    # THEN minilm ran the 128 texts in fewer than 64 executions
    assert failures == []
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    print(
        f"minilm under 32 concurrent topics clients: {inferences} inferences in {executions} executions"
    )
    assert inferences == 128
    assert executions < inferences / 2


@pytest.mark.parametrize("transport", ["gpu", "cpu"])
def test_a_failed_condition_skips_its_step_and_says_so(
    bases: dict[str, str], transport: str
) -> None:
    base = bases[transport]
    # WHEN a benign and a hostile text go through the moderation pipeline
    benign, benign_out = infer(base, "moderation", texts(BENIGN))
    hostile, hostile_out = infer(base, "moderation", texts(HOSTILE))
    # THEN the review step ran only for the text the topics head flagged
    assert benign_out["scores"][0, REVIEW] < 0.5 <= hostile_out["scores"][0, REVIEW]
    assert benign["parameters"]["skipped_steps"] == "2:review-head"
    assert set(benign_out) == {"label", "scores"}
    assert "skipped_steps" not in hostile.get("parameters", {})
    embedding = infer(base, "minilm", texts(HOSTILE))[1]["embedding"]
    np.testing.assert_allclose(hostile_out["peak"], embedding.max(axis=1, keepdims=True), atol=1e-6)


def test_bad_pipelines_are_refused_with_the_reason(gpu: Service, cpu: CpuService) -> None:
    # WHEN the repository index is read
    status, _, body = call(gpu.base, "/v2/repository/index", b"")
    assert status == 200
    rows = {row["name"]: row for row in json.loads(body)}
    # THEN each broken pipeline is UNAVAILABLE with what is wrong; the good ones are READY
    assert rows["broken"]["state"] == "UNAVAILABLE"
    assert "step 0 (nosuch): unknown model 'nosuch'" in rows["broken"]["reason"]
    assert "'text' is BYTES but topics-head.embedding takes FP32" in rows["tangled"]["reason"]
    assert rows["topics"]["state"] == rows["moderation"]["state"] == "READY"
    # AND requests for them are refused with that reason, here and on the CPU fallback
    body_json, _ = encode_request(texts(BENIGN), binary=False)
    status, _, answer = call(gpu.base, "/v2/models/broken/infer", body_json)
    assert (status, json.loads(answer)["code"]) == (503, "model_not_ready")
    assert "unknown model 'nosuch'" in json.loads(answer)["error"]
    assert call(gpu.base, "/v2/models/broken/ready")[0] == 400
    with running(CpuApp(cpu)) as url:
        status, _, answer = call(url, "/v2/models/tangled/infer", body_json)
    assert (status, json.loads(answer)["code"]) == (503, "model_not_ready")


def test_metadata_stats_and_metrics_per_pipeline_and_step(
    gpu: Service, bases: dict[str, str]
) -> None:
    infer(gpu.base, "topics", texts("Metrics are counted per step."))
    for base in (gpu.base, bases["cpu"]):
        status, _, body = call(base, "/v2/models/topics")
        meta = json.loads(body)
        assert (status, meta["platform"], meta["parameters"]["steps"]) == (
            200,
            "ensemble",
            "0:minilm,1:topics-head",
        )
        assert [i["shape"] for i in meta["inputs"]] == [[-1, 1]]
    stats = model_stats(gpu.base, "topics")
    steps = stats["spillway"]["steps"]
    assert [s["step"] for s in steps] == ["0:minilm", "1:topics-head"]
    assert stats["execution_count"] >= 1
    assert steps[1]["runs"] == stats["execution_count"]
    _, _, text = call(gpu.base, "/metrics")
    metrics = text.decode()
    assert 'spillway_pipeline_request_success_total{pipeline="topics"}' in metrics
    assert 'spillway_pipeline_step_runs_total{pipeline="topics",step="0",model="minilm"}' in metrics
    assert (
        'spillway_pipeline_cache_misses_total{pipeline="topics",step="0",model="minilm"}' in metrics
    )


def test_the_cache_hits_and_a_new_version_never_serves_a_stale_entry(
    gpu: Service, repo: Path, signed: dict[str, str]
) -> None:
    # GIVEN a text the service has not seen, sent with the scope the router signs
    text = texts("A cached sentence about a quiet lake at dawn.")
    first, reference = infer(gpu.base, "topics", text, scope=signed)
    before = model_stats(gpu.base, "topics")["spillway"]["steps"][0]
    # WHEN it comes again
    again, outputs = infer(gpu.base, "topics", text, scope=signed)
    # THEN the embedding step came from the cache, with the same answer
    assert "parameters" not in first or "cached_steps" not in first["parameters"]
    assert again["parameters"]["cached_steps"] == "0:minilm"
    np.testing.assert_array_equal(outputs["scores"], reference["scores"])
    after = model_stats(gpu.base, "topics")["spillway"]["steps"][0]
    assert after["cache_hits"] == before["cache_hits"] + 1
    # WHEN minilm gets a new version (swapped in by the control API)
    source = repo / "minilm" / "1"
    files = {p.name: p for p in source.iterdir() if p.name != "SHA256SUMS"}
    assert LocalRepository(repo).publish_version("minilm", files) == 2
    assert call(gpu.base, "/v2/repository/models/minilm/load", b"")[0] == 200
    # THEN the same text is computed again by version 2, then cached for it
    fresh, _ = infer(gpu.base, "topics", text, scope=signed)
    assert "cached_steps" not in fresh.get("parameters", {})
    again, _ = infer(gpu.base, "topics", text, scope=signed)
    assert again["parameters"]["cached_steps"] == "0:minilm"
    assert model_stats(gpu.base, "minilm")["version"] == "2"


def test_the_shared_cache_is_shared_by_replicas(
    aws_env: str, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a DynamoDB table and a bucket as the shared tier, and no memory tier
    table, bucket = "spillway-step-cache", "spillway-step-cache"
    dynamodb = aws_client("dynamodb")
    dynamodb.create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "key", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "key", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    aws_client("s3").create_bucket(Bucket=bucket)
    for name, value in {"MB": "0", "TABLE": table, "LOCATION": f"s3://{bucket}/steps"}.items():
        monkeypatch.setenv(f"PIPELINE_CACHE_{name}", value)
    # WHEN one CPU replica answers a text, then a second replica answers it (each
    # verifying the scope the router signed with the key they share)
    body, _ = encode_request(texts("Two replicas, one cache."), binary=False)
    proofs = ScopeProofs(StaticKeys(KeyRing(uuid.uuid4().hex.encode() * 2)))
    settings = CpuSettings(repository=str(repo), models=["topics"])
    first = CpuService.load(settings, scopes=proofs)
    answer = json.loads(first.infer("topics", None, body, None, tenant_scope=proofs.sign("-")).body)
    second = CpuService.load(settings, scopes=proofs)
    again = json.loads(second.infer("topics", None, body, None, tenant_scope=proofs.sign("-")).body)
    # THEN the second took the embedding from the first's entry
    assert "parameters" not in answer
    assert again["parameters"] == {"cached_steps": "0:minilm"}
    assert again["outputs"] == answer["outputs"]


def test_the_shared_tier_keeps_big_entries_in_s3_and_skips_expired_ones(aws_env: str) -> None:
    table, bucket = "spillway-step-cache-2", "spillway-step-cache-2"
    aws_client("dynamodb").create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "key", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "key", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    aws_client("s3").create_bucket(Bucket=bucket)
    now = [1_000_000.0]
    settings = CacheSettings(table=table, location=f"s3://{bucket}/big", ttl_s=60)
    cache = SharedCache(settings, aws_client, clock=lambda: now[0])
    small = {"v": np.arange(4, dtype=np.float32)}
    big = {"v": np.arange(200_000, dtype=np.float32)}  # 800 KB: past an item's limit
    cache.put_many([("m/1/small", small), ("m/1/big", big)])
    found = cache.get_many(["m/1/small", "m/1/big", "m/1/none"])
    assert found[2] is None
    np.testing.assert_array_equal(found[0]["v"], small["v"])  # type: ignore[index]
    np.testing.assert_array_equal(found[1]["v"], big["v"])  # type: ignore[index]
    assert [o["Key"] for o in aws_client("s3").list_objects_v2(Bucket=bucket)["Contents"]] == [
        "big/m/1/big"
    ]
    now[0] += 61  # past the TTL: DynamoDB deletes lazily, the reader skips it
    assert cache.get_many(["m/1/small"]) == [None]
    broken = SharedCache(CacheSettings(table="no-such-table"), aws_client)
    assert broken.get_many(["m/1/small"]) == [None]  # a storage failure is a miss


def test_the_cache_saves_the_embedding_on_repeats(gpu: Service, signed: dict[str, str]) -> None:
    # Prints the latency effect for the record; asserts that every repeat was a hit.
    sentences = [
        f"Latency sample {i}: the committee met to discuss the stadium budget." for i in range(20)
    ]

    def timed(text: str) -> tuple[float, str]:
        started = time.perf_counter()
        header, _ = infer(gpu.base, "topics", texts(text), scope=signed)
        return time.perf_counter() - started, header.get("parameters", {}).get("cached_steps", "")

    misses = [timed(s) for s in sentences]
    hits = [timed(s) for s in sentences]
    assert {c for _, c in misses} == {""}
    assert {c for _, c in hits} == {"0:minilm"}
    p50 = [sorted(t for t, _ in runs)[len(runs) // 2] * 1e3 for runs in (misses, hits)]
    print(
        f"topics p50 latency: {p50[0]:.1f} ms computed, {p50[1]:.1f} ms with the embedding cached"
    )


def test_the_state_machine_runs_the_pipeline_one_step_per_call(
    aws_env: str, cpu: CpuService
) -> None:
    # GIVEN the checked-in definition, the CPU function's chain handler over moto S3, and
    # two requests staged where the async path stages them (one with an empty text)
    bucket = "spillway-chain"
    s3 = aws_client("s3")
    s3.create_bucket(Bucket=bucket)
    store = ChainStore(parse_s3_url(f"s3://{bucket}/async"), s3)
    function = "arn:aws:lambda:us-east-1:123456789012:function:spillway-cpu-infer:live"
    definition = json.loads(definition_path("topics").read_text())
    local = substituted(definition, substitutions(function, bucket))
    calls: list[tuple[str, int | None]] = []
    hiccup = [ServerFault('{"status": 503, "code": "unavailable", "error": "busy"}')]

    def cpu_function(event: dict[str, Any]) -> dict[str, Any]:
        calls.append((event["spillway"], event.get("step")))
        if event.get("step") == 1 and hiccup:
            raise hiccup.pop()  # one transient failure: retried
        return handle_chain_event(cpu, event, store)

    machine = LocalStateMachine(
        local, functions={function: cpu_function}, s3=s3, sleep=lambda _: None
    )
    good, bad = uuid.uuid4().hex, uuid.uuid4().hex
    request = texts(HOSTILE, BENIGN)
    body, length = encode_request(request, binary=True, binary_outputs=True)
    s3.put_object(
        Bucket=bucket, Key=f"async/{good}/request.v2req", Body=stage_request(body, length)
    )
    empty, _ = encode_request(texts("  "), binary=False)
    s3.put_object(Bucket=bucket, Key=f"async/{bad}/request.v2req", Body=stage_request(empty, None))
    # WHEN both run
    anonymous = {"tenant_scope": "-"}
    done, failed = machine.run({"id": good, **anonymous}), machine.run({"id": bad, **anonymous})
    # THEN the good one's result equals the synchronous answer, after one retried step
    assert done.status == "SUCCEEDED", done
    assert ("Step1-topics-head", "retry 1 after ServerFault") in done.history
    staged = s3.get_object(Bucket=bucket, Key=f"async/{good}/result")["Body"].read()
    header, outputs = decode_response(*read_staged_request(staged))
    sync = cpu.infer("topics", None, body, length)
    _, expected = decode_response(sync.body, sync.header_length)
    assert (header.model_name, header.model_version) == ("topics", "1")
    assert labels(outputs) == labels(expected)
    np.testing.assert_allclose(outputs["scores"], expected["scores"], atol=1e-6)
    # AND the bad one stopped at its first step, with the reason in its error record
    assert failed.status == "FAILED"
    record = json.loads(s3.get_object(Bucket=bucket, Key=f"async/{bad}/error.json")["Body"].read())
    assert record["Error"] == "ClientFault"
    assert json.loads(json.loads(record["Cause"])["errorMessage"])["code"] == "invalid_input"
    assert calls.count(("pipeline-step", 0)) == 2  # once for each request, never retried
    assert calls.count(("pipeline-step", 1)) == 2  # the good one's, tried twice


def test_the_topics_build_is_deterministic_and_loads(models_dir: Path, tmp_path: Path) -> None:
    # GIVEN a repository holding only minilm
    for out in (tmp_path / "a", tmp_path / "b"):
        out.mkdir()
        link_model(models_dir, out, "minilm")
    # WHEN topics is built twice
    reports = [build_topics(tmp_path / "a"), build_topics(tmp_path / "b")]
    # THEN both builds are the same bytes, and the labels classify their own descriptions
    assert reports[0].sha256 == reports[1].sha256
    assert reports[0].metrics["description_accuracy"] >= 0.9
    assert (tmp_path / "a" / "topics" / "1" / "SHA256SUMS").read_text() == ""
    config = json.loads((tmp_path / "a" / "topics" / "config.json").read_text())
    assert config["platform"] == "ensemble"
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == [
        "minilm",
        "topics-head",
    ]
