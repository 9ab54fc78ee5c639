"""The local stack's moto server answers each DynamoDB write with that write's own result,
as DynamoDB does, while other threads write the same item (``spillway_cli.local.moto_atomic``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
from botocore.config import Config

THREADS, WRITES = 16, 40


def test_concurrent_writes_to_one_item_each_answer_their_own_result(aws_env: str) -> None:
    # GIVEN one item (moto reads all its attributes to answer a write to it)
    client = boto3.client("dynamodb", config=Config(max_pool_connections=THREADS))
    client.create_table(
        TableName="atomic-answers",
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    key = {"pk": {"S": "one"}}

    def write(worker: int) -> list[int]:
        # each write adds one to a counter and sets or removes an attribute of its own,
        # so that the item's attributes change while another write's answer is being read
        mine = boto3.client("dynamodb", config=Config(retries={"max_attempts": 1}))
        seen = []
        for n in range(WRITES):
            values = {":one": {"N": "1"}}
            if n % 2 == 0:
                values[":v"] = {"S": "x" * 64}
            answer: dict[str, Any] = mine.update_item(
                TableName="atomic-answers",
                Key=key,
                UpdateExpression="ADD n :one " + ("SET #a = :v" if n % 2 == 0 else "REMOVE #a"),
                ExpressionAttributeNames={"#a": f"w{worker}"},
                ExpressionAttributeValues=values,
                ReturnValues="ALL_NEW",
            )
            seen.append(int(answer["Attributes"]["n"]["N"]))
        return seen

    # WHEN 16 threads each write it 40 times (no retries: a 500 fails the test)
    with ThreadPoolExecutor(THREADS) as pool:
        answers = [n for seen in pool.map(write, range(THREADS)) for n in seen]
    # THEN every write was answered with the counter as it left it: 1 to 640, once each
    assert sorted(answers) == list(range(1, THREADS * WRITES + 1))
    item = client.get_item(TableName="atomic-answers", Key=key, ConsistentRead=True)["Item"]
    assert int(item["n"]["N"]) == THREADS * WRITES
