"""What a local stack keeps across restarts (``spillway_cli.local.keep``), on a real moto
server: saved when the stack stops, restored into fresh resources when it starts; what
ended with the stack (WebSocket connections, expired items) is not; a folder file removed
from the repository stays removed; ``--fresh`` sets the state aside."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from spillway.aws.clients import aws_client
from spillway.state.table import DynamoStateStore, create_table
from spillway.tenancy.directory import ConfigWriter
from spillway_cli.local.async_resources import create_async_resources
from spillway_cli.local.keep import KeptStateError, Resources, StateKeeper

REGION = "us-east-1"
POLICY = "rules: []\n"


def _clients(service: str) -> Any:
    return aws_client(service, REGION)


def _resources() -> Resources:
    suffix = uuid.uuid4().hex[:10]
    return Resources(
        buckets=(f"models-{suffix}", f"data-{suffix}"),
        repository=(f"models-{suffix}", "repository/"),
        state_table=f"state-{suffix}",
        async_table=f"async-{suffix}",
        jobs_table=f"jobs-{suffix}",
        queues=(f"async-{suffix}", f"dlq-{suffix}"),
    )


def _create(res: Resources) -> None:
    """The stack's resources, empty."""
    s3, dynamodb = _clients("s3"), _clients("dynamodb")
    for bucket in res.buckets:
        s3.create_bucket(Bucket=bucket)
    create_table(dynamodb, res.state_table)
    create_async_resources(res.buckets[1], names=(res.async_table, res.queues[0], res.queues[1]))
    dynamodb.create_table(
        TableName=res.jobs_table,
        KeySchema=[{"AttributeName": "job_id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "job_id", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )


def _drop(res: Resources) -> None:
    """What moto forgets when it stops."""
    s3, dynamodb, sqs = _clients("s3"), _clients("dynamodb"), _clients("sqs")
    for bucket in res.buckets:
        for found in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=found["Key"])
        s3.delete_bucket(Bucket=bucket)
    for table in res.tables:
        dynamodb.delete_table(TableName=table)
    for queue in res.queues:
        sqs.delete_queue(QueueUrl=sqs.get_queue_url(QueueName=queue)["QueueUrl"])


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A models folder: m1 (config, version 1), gone (config), and files never uploaded."""
    models = tmp_path / "models"
    (models / "m1" / "1").mkdir(parents=True)
    (models / "m1" / "samples").mkdir()
    (models / "gone").mkdir()
    (models / "m1" / "config.json").write_text("{}")
    (models / "m1" / "1" / "model.onnx").write_bytes(b"onnx-1")
    (models / "m1" / "samples" / "x.npy").write_bytes(b"sample")
    (models / "gone" / "config.json").write_text("{}")
    return models


def _give(res: Resources) -> None:
    """What a user gives a running stack, and what ends with it."""
    s3, dynamodb, sqs = _clients("s3"), _clients("dynamodb"), _clients("sqs")
    models, data = res.buckets
    s3.put_object(Bucket=models, Key="repository/m1/2/model.onnx", Body=b"onnx-2")
    s3.put_object(
        Bucket=data,
        Key="async/r1/result.json",
        Body=b'{"ok": 1}',
        ContentType="application/json",
        Metadata={"tenant": "acme"},
    )
    s3.delete_object(Bucket=models, Key="repository/gone/config.json")
    store = DynamoStateStore(res.state_table, lambda: _clients("dynamodb"))
    ConfigWriter(store).add("key-1", "acme")
    store.put("canary#m1", {"stable": 1}, None)
    store.put("session#s#live", {"step": 1}, time.time() + 3600)
    store.put("session#s#expired", {"step": 1}, time.time() - 10)
    store.put("wsconn#abc", {"tenant": "acme"}, None)
    dynamodb.put_item(
        TableName=res.async_table,
        Item={"id": {"S": "r1"}, "state": {"S": "queued"}, "created_at": {"N": "1"}},
    )
    dynamodb.put_item(
        TableName=res.jobs_table, Item={"job_id": {"S": "j1"}, "blob": {"B": b"\x00\xff"}}
    )
    sqs.send_message(
        QueueUrl=sqs.get_queue_url(QueueName=res.queues[0])["QueueUrl"],
        MessageBody="message-1",
        MessageAttributes={"kind": {"DataType": "String", "StringValue": "infer"}},
    )


def test_a_restart_gets_back_what_the_stack_was_given(
    aws_env: str, folder: Path, tmp_path: Path
) -> None:
    # GIVEN a stack that started clean, was given models, tenants, canaries, sessions,
    # async records, jobs and a queued message, and stopped (saved, then moto forgot it)
    res, state = _resources(), tmp_path / "state"
    _create(res)
    first = StateKeeper(state, res, _clients)
    first.begin(fresh=False)
    assert first.upload_folder(folder) == (3, 0)
    assert first.put_back() == f"nothing kept in {state} yet: starting clean"
    first.started()
    _give(res)
    saved = first.save(POLICY)
    assert saved is not None
    _drop(res)
    _create(res)
    # WHEN the stack starts again
    second = StateKeeper(state, res, _clients)
    second.begin(fresh=False)
    uploaded = second.upload_folder(folder)
    line = second.put_back()
    # THEN it says what it restored, as the stop said what it kept
    described = (
        "1 model (1 version), 1 tenant, 1 canary, 1 async record, 1 job, 1 session, "
        "1 queued message, 2 S3 objects, the policy applied"
    )
    assert saved.describe() == described
    assert line == f"restored {described} from {state}"
    assert second.policy == POLICY
    # AND the folder's removed file stays removed, the added version and the data are back
    assert uploaded == (2, 1)
    s3, models, data = _clients("s3"), *res.buckets
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=models)["Contents"]}
    assert keys == {
        "repository/m1/config.json",
        "repository/m1/1/model.onnx",
        "repository/m1/2/model.onnx",
    }
    assert (
        s3.get_object(Bucket=models, Key="repository/m1/2/model.onnx")["Body"].read() == b"onnx-2"
    )
    result = s3.get_object(Bucket=data, Key="async/r1/result.json")
    assert (result["ContentType"], result["Metadata"]) == ("application/json", {"tenant": "acme"})
    # AND the items, but what ended with the stack
    store = DynamoStateStore(res.state_table, lambda: _clients("dynamodb"))
    assert ConfigWriter(store).read().identities == {"key-1": "acme"}
    now = time.time()
    assert store.get("canary#m1", now) is not None
    assert store.get("session#s#live", now) is not None
    pks = {i["pk"]["S"] for i in _clients("dynamodb").scan(TableName=res.state_table)["Items"]}
    assert not {"wsconn#abc", "session#s#expired"} & pks
    job = _clients("dynamodb").get_item(TableName=res.jobs_table, Key={"job_id": {"S": "j1"}})
    assert job["Item"]["blob"]["B"] == b"\x00\xff"
    # AND the queued message
    sqs = _clients("sqs")
    got = sqs.receive_message(
        QueueUrl=sqs.get_queue_url(QueueName=res.queues[0])["QueueUrl"],
        MessageAttributeNames=["All"],
    )["Messages"]
    assert [(m["Body"], m["MessageAttributes"]["kind"]["StringValue"]) for m in got] == [
        ("message-1", "infer")
    ]


def test_an_unchanged_object_is_not_copied_again_and_fresh_sets_the_state_aside(
    aws_env: str, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a kept state holding an added version, restored by a running stack
    res, state = _resources(), tmp_path / "state"
    _create(res)
    first = StateKeeper(state, res, _clients)
    first.begin(fresh=False)
    first.upload_folder(folder)
    first.started()
    _clients("s3").put_object(Bucket=res.buckets[0], Key="repository/m1/2/a", Body=b"2")
    first.save(None)
    second = StateKeeper(state, res, _clients)
    second.begin(fresh=False)
    second.upload_folder(folder)
    second.put_back()
    second.started()

    def no_download(*args: object) -> None:
        raise AssertionError("an unchanged object was copied again")

    # WHEN it stops with nothing changed
    monkeypatch.setattr(second, "_download", no_download)
    kept = second.save(None)
    # THEN the save reused its object file (one file, the one kept)
    assert kept is not None
    assert kept.objects == 1
    assert len(list((state / "objects").iterdir())) == 1
    # AND WHEN it starts with --fresh THEN the state moves aside and nothing is restored
    fresh = StateKeeper(state, res, _clients)
    fresh.begin(fresh=True)
    previous = tmp_path / "state.previous"
    assert fresh.put_back() == f"--fresh: starting clean (moved to {previous})"
    assert json.loads((previous / "state.json").read_text())["format"] == 1
    assert not state.exists()


def test_an_unreadable_state_names_the_way_out(aws_env: str, tmp_path: Path) -> None:
    # GIVEN a kept state that is not JSON
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text("{not json")
    # WHEN a stack starts on it THEN it stops, naming the file and --fresh
    with pytest.raises(KeptStateError, match=r"state\.json cannot be read .*--fresh"):
        StateKeeper(tmp_path / "state", _resources(), _clients).begin(fresh=False)
