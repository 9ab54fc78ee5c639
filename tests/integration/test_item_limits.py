"""What the product puts in S3 keys, DynamoDB items and SQS messages stays within AWS's
limits, or is refused at once with a 400; and the local moto refuses past them as AWS
does (``spillway_cli.local.moto_atomic.strict_limits``: moto alone stores a 1,100-byte S3 key
and counts an SQS body's characters, not its bytes, nor its attributes).

AWS's limits (``spillway.aws.limits``): an S3 key is 1,024 bytes of UTF-8; an
SQS message 1 MiB, body and attributes; a DynamoDB item 400 KB, names and values.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from spillway.async_inference.objects import RESULT_NAME_BYTES
from spillway.async_inference.records import to_item
from spillway.async_inference.store import AsyncStore
from spillway.aws.clients import aws_client
from spillway.aws.limits import DYNAMODB_ITEM_BYTES, S3_KEY_BYTES, SQS_MESSAGE_BYTES
from spillway.protocol.errors import InferenceError, InvalidInputError
from spillway.protocol.replies import error_reply, infer_reply
from spillway_cli.local.async_resources import create_async_resources
from spillway_cli.local.moto_atomic import strict_limits

BODY = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
CLEF = "\U0001d11e"  # four bytes of UTF-8


@pytest.fixture
def strict(aws_env: str) -> Iterator[str]:
    """The session's moto server, refusing past AWS's limits for this test."""
    undo = strict_limits()
    yield aws_env
    undo()


@pytest.fixture
def store(strict: str) -> AsyncStore:
    suffix = uuid.uuid4().hex[:8]
    settings = create_async_resources(
        f"items-{suffix}", max_attempts=1, names=(f"t-{suffix}", f"q-{suffix}", f"dlq-{suffix}")
    )
    return AsyncStore(settings)


def _key_bytes(url: str) -> int:
    return len(url.removeprefix("s3://").partition("/")[2].encode())


# --- the stand-in ------------------------------------------------------------------------


def test_moto_refuses_an_s3_key_past_1024_bytes(strict: str) -> None:
    s3 = aws_client("s3")
    bucket = f"keys-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    # WHEN keys of 1,024 bytes and of 1,025 (a four-byte character last) are written
    s3.put_object(Bucket=bucket, Key="k" * S3_KEY_BYTES, Body=b"x")
    with pytest.raises(ClientError) as raised:
        s3.put_object(Bucket=bucket, Key="k" * (S3_KEY_BYTES - 3) + CLEF, Body=b"x")
    # THEN the second is S3's KeyTooLongError
    assert raised.value.response["Error"]["Code"] == "KeyTooLongError"


def test_moto_counts_an_sqs_messages_bytes_and_attributes(strict: str) -> None:
    sqs = aws_client("sqs")
    url = sqs.create_queue(QueueName=f"size-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    # GIVEN a body of exactly 1 MiB, then 1 MiB of bytes in fewer characters, then a body
    # within the limit whose attribute takes it past
    sqs.send_message(QueueUrl=url, MessageBody="x" * SQS_MESSAGE_BYTES)
    multibyte = "é" * (SQS_MESSAGE_BYTES // 2 + 1)
    attribute = {"note": {"DataType": "String", "StringValue": "y" * 100}}
    refusals = []
    for body, attributes in ((multibyte, {}), ("x" * (SQS_MESSAGE_BYTES - 50), attribute)):
        with pytest.raises(ClientError) as raised:
            sqs.send_message(QueueUrl=url, MessageBody=body, MessageAttributes=attributes)
        refusals.append(raised.value.response["Error"]["Code"])
    # THEN both are refused as SQS refuses them
    assert refusals == ["InvalidParameterValue"] * 2


def test_moto_refuses_a_dynamodb_item_past_400_kb(strict: str, store: AsyncStore) -> None:
    # WHEN an item of 400 KiB and one byte is written
    item = {"id": {"S": "big"}, "v": {"S": "x" * (DYNAMODB_ITEM_BYTES + 1 - len("idbigv"))}}
    with pytest.raises(ClientError) as raised:
        aws_client("dynamodb").put_item(TableName=store.table, Item=item)
    # THEN DynamoDB's ValidationException (moto's own check)
    assert raised.value.response["Error"]["Code"] == "ValidationException"


# --- the product: async requests ---------------------------------------------------------


def _submit(store: AsyncStore, **where: str) -> str:
    record, _ = store.submit(
        tenant="acme", model="digits", version=None, body=BODY.encode(), header_length=None,
        **where,  # type: ignore[arg-type]
    )  # fmt: skip
    return record.id


def _nothing_written(store: AsyncStore) -> bool:
    items = aws_client("dynamodb").scan(TableName=store.table)["Items"]
    listed = aws_client("s3").list_objects_v2(Bucket=store.location.bucket)
    return not items and not listed.get("Contents") and not store.receive(10, 0)


def test_an_output_location_too_long_for_its_result_key_is_refused_at_once(
    store: AsyncStore,
) -> None:
    area = store.areas("acme")[0]
    tail = len("/") + 33 + RESULT_NAME_BYTES  # "/", "<id>/", "result-<attempt>"
    # GIVEN output locations whose result (<location>/<id>/result-<attempt>) is at the
    # limit (its URL 1,024 characters, as the service reads it back), one character
    # more, and within the characters but past S3's 1,024 bytes of key
    room = S3_KEY_BYTES - len(area) - tail
    too_long = f"{area}{'o' * (room + 1)}/"
    too_many_bytes = f"{area}{CLEF * ((S3_KEY_BYTES - _key_bytes(area) - tail) // 4 + 1)}/"
    # WHEN acme submits either of the longer ones
    for output in (too_long, too_many_bytes):
        with pytest.raises(InvalidInputError, match="too long"):
            _submit(store, output_location=output)
    # THEN each is a 400 before anything is written (S3 would have refused the result
    # only after the run)
    assert _nothing_written(store)
    # AND the one at the limit runs, and its result is written and answered
    rid = _submit(store, output_location=f"{area}{'o' * room}/")
    (delivery,) = store.receive(10, 0)
    job = store.claim(delivery, "cpu")
    assert job is not None
    assert store.settle(job, infer_reply(b'{"outputs": []}', None, 1)) == "succeeded"
    result = store.result_url(rid)
    assert result is not None
    assert len(result) == S3_KEY_BYTES
    assert store.result_reply(rid, "acme").status == 200


def test_an_input_location_past_an_s3_key_is_a_400_not_a_503(store: AsyncStore) -> None:
    area = store.areas("acme")[0]
    # WHEN acme names an input whose key is longer than S3 allows (in fewer than the
    # 1,024 characters a location may have)
    name = CLEF * ((S3_KEY_BYTES - _key_bytes(area)) // 4 + 1)
    assert len(f"{area}{name}") < S3_KEY_BYTES
    with pytest.raises(InvalidInputError, match="too long"):
        _submit(store, input_location=f"{area}{name}")
    # THEN it is a 400 that says so, nothing written (not whatever S3 answers a HEAD
    # of a key it could never hold)
    assert _nothing_written(store)


def _item_bytes(value: Any) -> int:
    """A DynamoDB attribute value's size (the developer guide's item-size rules)."""
    ((kind, raw),) = value.items()
    if kind == "S":
        return len(raw.encode())
    if kind == "N":
        return len(str(Decimal(raw)).lstrip("-").replace(".", "")) // 2 + 2
    if kind == "M":
        return 3 + sum(len(k.encode()) + 1 + _item_bytes(v) for k, v in raw.items())
    if kind == "L":
        return 3 + sum(1 + _item_bytes(v) for v in raw)
    return 1


def test_the_largest_record_and_dead_letter_stay_within_dynamodb_and_sqs(
    store: AsyncStore,
) -> None:
    area = store.areas("acme")[0]
    # GIVEN a request naming the longest output location allowed (four-byte characters)
    room = S3_KEY_BYTES - _key_bytes(area) - len("/") - 33 - RESULT_NAME_BYTES
    rid = _submit(store, output_location=f"{area}{CLEF * (room // 4)}/")
    assert store.find(rid) is not None
    # WHEN it fails on its last attempt with an error message far past what a record keeps
    (delivery,) = store.receive(10, 0)
    job = store.claim(delivery, "cpu")
    assert job is not None
    assert store.settle(job, error_reply(InferenceError(CLEF * 100_000))) == "failed"
    # THEN the record (error kept bounded) and the dead letter were written by a moto as
    # strict as AWS, each far within its limit
    record = store.find(rid)
    assert record is not None
    item = to_item(record)
    size = sum(len(name.encode()) + _item_bytes(value) for name, value in item.items())
    assert size < DYNAMODB_ITEM_BYTES // 50
    sqs = aws_client("sqs")
    dlq = sqs.get_queue_url(QueueName=store.queue_url.rsplit("/", 1)[-1].replace("q-", "dlq-"))
    (letter,) = sqs.receive_message(QueueUrl=dlq["QueueUrl"]).get("Messages", [])
    assert json.loads(letter["Body"])["id"] == rid
    assert len(letter["Body"].encode()) < SQS_MESSAGE_BYTES // 50


# --- the product: jobs ---------------------------------------------------------------------


def test_a_job_output_too_long_for_its_keys_is_refused_before_its_record(
    strict: str, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.integration.test_jobs_support import digits_images, put_jsonl, record
    from tests.integration.test_jobs_tenancy import _call, tenant_deployment

    # GIVEN tenant A's input (a job that could run)
    found, settings = tenant_deployment(strict, models_dir, monkeypatch)
    area = found.area("tenant-a")
    image = digits_images(models_dir)[0].tolist()
    put_jsonl(found.data, f"{area.split('/', 3)[3]}in/0.jsonl", [record("r0", image=image)])
    longest = len("/") + 36 + len("/_tmp/part-9999999999.manifest.json")
    room = S3_KEY_BYTES - _key_bytes(area) - longest
    job = {"model": "digits", "input": f"{area}in/"}
    records = aws_client("dynamodb").scan(TableName=settings.table)["Items"]  # other tests'
    # WHEN tenant A asks for outputs one byte past what its keys may take
    status, answer = _call("a", "POST", "/v1/jobs", {**job, "output": f"{area}{'o' * (room + 1)}"})
    # THEN it is a 400 naming the length, and no job record was written
    assert (status, answer["code"]) == (400, "invalid_input"), answer
    assert "too long" in answer["error"]
    assert aws_client("dynamodb").scan(TableName=settings.table)["Items"] == records
