"""The async-inference resources of the local stack, on the moto server: the table (with
its sparse ``pending`` index), the queue with its dead-letter queue (redrive after
``max_attempts`` deliveries) and the bucket, as the templates declare them on AWS."""

from __future__ import annotations

import contextlib
import json

from spillway.async_inference.settings import AsyncSettings
from spillway.aws.clients import aws_client

TABLE = "spillway-async"
QUEUE = "spillway-async"
DEAD_LETTERS = "spillway-async-dlq"


def create_async_resources(
    bucket: str,
    *,
    prefix: str = "async",
    max_attempts: int = 3,
    lease_s: int = 10,
    drain_age_s: float = 5.0,
    names: tuple[str, str, str] = (TABLE, QUEUE, DEAD_LETTERS),
) -> AsyncSettings:
    """Create (or find) the resources; the settings that name them. Locally the lease and
    the drain age are short so a killed consumer's work comes back within seconds."""
    table, queue, dead_letters = names
    dynamodb, sqs, s3 = aws_client("dynamodb"), aws_client("sqs"), aws_client("s3")
    if table not in dynamodb.list_tables()["TableNames"]:
        dynamodb.create_table(
            TableName=table,
            KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
            AttributeDefinitions=[
                {"AttributeName": "id", "AttributeType": "S"},
                {"AttributeName": "pending", "AttributeType": "S"},
                {"AttributeName": "created_at", "AttributeType": "N"},
            ],
            GlobalSecondaryIndexes=[
                {
                    "IndexName": "pending",
                    "KeySchema": [
                        {"AttributeName": "pending", "KeyType": "HASH"},
                        {"AttributeName": "created_at", "KeyType": "RANGE"},
                    ],
                    "Projection": {"ProjectionType": "KEYS_ONLY"},
                }
            ],
            BillingMode="PAY_PER_REQUEST",
        )
        dynamodb.update_time_to_live(
            TableName=table,
            TimeToLiveSpecification={"Enabled": True, "AttributeName": "expires_at"},
        )
    dlq_url = sqs.create_queue(QueueName=dead_letters)["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    redrive = {"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(max_attempts)}
    queue_url = sqs.create_queue(
        QueueName=queue,
        Attributes={"VisibilityTimeout": str(lease_s), "RedrivePolicy": json.dumps(redrive)},
    )["QueueUrl"]
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=bucket)
    return AsyncSettings(
        table=table,
        queue_url=queue_url,
        location=f"s3://{bucket}/{prefix}",
        max_attempts=max_attempts,
        lease_s=lease_s,
        drain_age_s=drain_age_s,
    )


def async_env(settings: AsyncSettings) -> dict[str, str]:
    """The ``ASYNC_*`` variables of these settings (for the stack's processes)."""
    values = settings.model_dump(exclude_none=True, exclude_defaults=False)
    env: dict[str, str] = {}
    for name, value in values.items():
        if isinstance(value, list):
            value = ",".join(value)
        elif isinstance(value, dict):
            value = json.dumps(value)
        env[f"ASYNC_{name.upper()}"] = str(value)
    return env
