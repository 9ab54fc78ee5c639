"""The dashboard's operator view read from real stores (DynamoDB, SQS, S3 and SSM on a
moto server) and a real CPU fallback over a model built here: every figure is compared
with what the store itself answers."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from batch_job.jobstore import JobStore
from spillway.async_inference.store import AsyncStore
from spillway.aws.clients import aws_client
from spillway.canary.records import CanaryStore
from spillway.fallback.app import CpuApp
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.config import CHECKSUM_FILE
from spillway.models.repository import checksums_text
from spillway.policy.rules import parse_policy
from spillway.policy.store import FileSource, SsmSource
from spillway.state.table import DynamoStateStore, create_table, scope
from spillway_cli.dashboard.operator import Operator
from spillway_cli.local.async_resources import create_async_resources
from spillway_cli.local.wsgi_server import running
from tests import graphs

POLICY = Path(__file__).resolve().parents[2] / "policies" / "example.yaml"
TENANTS = ("acme", "globex")


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def cpu_url(tmp_path: Path) -> Iterator[str]:
    """The CPU fallback over a repository with versions 1 and 3 of ``dense``."""
    for version in (1, 3):
        graph = graphs.dense(tmp_path / "dense" / str(version) / "model.onnx")
        (graph.parent / CHECKSUM_FILE).write_text(checksums_text({"model.onnx": graph}))
    config = {
        "name": "dense",
        "platform": "onnxruntime_onnx",
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [3]}],
        "version_policy": {"all": {}},
    }
    (tmp_path / "dense" / "config.json").write_text(json.dumps(config))
    service = CpuService.load(CpuSettings(repository=str(tmp_path)))
    with running(CpuApp(service)) as url:
        yield url


def test_canaries_and_served_versions_come_from_the_state_table_and_the_backend(
    aws_env: str, cpu_url: str
) -> None:
    table = _unique("state")
    create_table(aws_client("dynamodb"), table)
    canaries = CanaryStore(DynamoStateStore(table, lambda: aws_client("dynamodb")), time.time)
    canaries.start("dense", 3, 25, stable=1)
    operator = Operator(state_table=table, backends={"cpu": cpu_url})
    view = operator.read(["dense", "absent"])
    assert view["canaries"]["models"]["dense"] == {
        "stable": 1,
        "canary": 3,
        "percent": 25.0,
        "status": "running",
        "running": True,
        "rolled_back": [],
        "last_event": "started",
        "last_reason": "",
    }
    assert "absent" not in view["canaries"]["models"]
    assert view["versions"] == {"absent": {"cpu": "not served"}, "dense": {"cpu": ["1", "3"]}}
    canaries.rollback("dense", 3, "p99 too high")
    rolled = operator.read(["dense"])["canaries"]["models"]["dense"]
    assert (rolled["status"], rolled["rolled_back"], rolled["last_reason"]) == (
        "rolled_back",
        [3],
        "p99 too high",
    )


def test_a_process_start_is_counted_each_time_its_health_answers_again(cpu_url: str) -> None:
    dead = "http://127.0.0.1:9"  # the discard port: nothing answers
    operator = Operator(backends={"cpu": cpu_url})
    assert operator.read([])["process_starts"] == {"cpu": 1}
    assert operator.read([])["process_starts"] == {"cpu": 1}  # still the same process
    operator.backends["cpu"] = dead
    down = operator.read(["dense"])
    assert down["process_starts"] == {"cpu": 1}
    assert down["versions"] == {"dense": {"cpu": "not answering"}}  # and not asked more
    operator.backends["cpu"] = cpu_url
    assert operator.read([])["process_starts"] == {"cpu": 2}  # up again: started again


def test_the_policy_in_force_is_the_routers_file_or_parameter_with_its_digest(
    aws_env: str, tmp_path: Path
) -> None:
    text = POLICY.read_text()
    rules = [rule.name for rule in parse_policy(text, "example").rules]
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    from_file = Operator(policy=FileSource(POLICY)).read([])["policy"]
    assert (from_file["digest"], [r["name"] for r in from_file["rules"]]) == (digest, rules)
    assert from_file["source"] == str(POLICY)
    parameter = f"/{_unique('policy')}"
    aws_client("ssm").put_parameter(Name=parameter, Value=text, Type="String")
    from_ssm = Operator(policy=SsmSource(parameter)).read([])["policy"]
    assert (from_ssm["digest"], from_ssm["source"]) == (digest, f"ssm:{parameter}")
    assert from_ssm["rules"] == from_file["rules"]
    broken = tmp_path / "broken.yaml"
    broken.write_text("rules: []\n")
    assert "error" in Operator(policy=FileSource(broken)).read([])["policy"]


def test_the_async_backlog_counts_every_tenants_pending_requests(aws_env: str) -> None:
    names = (_unique("async"), _unique("async"), _unique("async-dlq"))
    settings = create_async_resources(_unique("bucket"), names=names)
    store = AsyncStore(settings)
    submitted = [
        store.submit(tenant=t, model="dense", version=None, body=b"{}", header_length=None)[0]
        for t in ("acme", "acme", "globex")
    ]
    oldest = min(r.created_at for r in submitted)
    operator = Operator(async_settings=settings, clock=lambda: oldest + 42.0)
    backlog = operator.read([])["async"]
    assert backlog == {
        "pending": 3,
        "queued": 3,
        "running": 0,
        "oldest_age_s": 42.0,
        "tenants": {"acme": 2, "globex": 1},
        "capped": False,
    }
    assert store.find(submitted[0].id) is not None
    assert Operator(async_settings=settings, backlog_limit=2).read([])["async"]["capped"]


def test_recent_jobs_of_every_tenant_newest_first(aws_env: str) -> None:
    table = _unique("jobs")
    client = aws_client("dynamodb")
    client.create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "job_id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "job_id", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    store = JobStore(table, client)
    ids = [str(uuid.uuid4()) for _ in range(3)]
    for i, (job_id, tenant) in enumerate(zip(ids, ("acme", "globex", "acme"), strict=True)):
        record = {
            "job_id": job_id,
            "owner": scope(tenant),
            "model": "dense",
            "state": "SUBMITTED",
            "created_at": f"2026-12-01T10:0{i}:00+00:00",
        }
        assert store.create(record)
    states = {ids[1]: "RUNNING"}
    operator = Operator(
        jobs_table=table,
        jobs_status=lambda job_id: type("Status", (), {"state": states[job_id]})(),
        jobs_shown=2,
    )
    jobs = operator.read([])["jobs"]
    assert jobs["total"] == 3
    assert [(r["job_id"], r["tenant_scope"], r["state"]) for r in jobs["rows"]] == [
        (ids[2], scope("acme"), "SUBMITTED"),  # no status answer: the record's own state
        (ids[1], scope("globex"), "RUNNING"),
    ]
    assert jobs["states"] == {"RUNNING": 1, "SUBMITTED": 1}


def test_an_unreachable_store_shows_its_error_and_the_rest_still_reads(aws_env: str) -> None:
    operator = Operator(state_table=_unique("missing"), jobs_table=_unique("missing"))
    view = operator.read(["dense"])
    assert "ResourceNotFoundException" in view["canaries"]["error"]
    assert "ResourceNotFoundException" in view["jobs"]["error"]
    assert view["policy"] is None
    assert view["async"] is None
