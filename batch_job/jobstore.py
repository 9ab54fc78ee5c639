"""Job records in DynamoDB; conditional writes make submission idempotent.

The partition key is ``job_id``. A submission with an idempotency key derives its job id
from the key, and creates the record only if none exists (``attribute_not_exists``), so
two concurrent submissions with one key cannot both go on to start a Batch job. A record
stays ``SUBMITTING`` until the Batch job exists; a submitter that died in between leaves a
lease that a later submission with the same key may take over once it expires.
"""

from __future__ import annotations

from typing import Any

from spillway.state import dynamo

SUBMITTING = "SUBMITTING"
SUBMITTED = "SUBMITTED"


class JobStore:
    """Job records in one DynamoDB table."""

    def __init__(self, table: str, client: Any) -> None:
        self.table = table
        self.client = client

    def _conditional(self, call: Any, **kwargs: Any) -> bool:
        return dynamo.conditional(call, TableName=self.table, **kwargs) is not None

    def create(self, record: dict[str, Any]) -> bool:
        """Write a new record; ``False`` when one with this job id exists."""
        return self._conditional(
            self.client.put_item,
            Item=dynamo.item(record),
            ConditionExpression="attribute_not_exists(job_id)",
        )

    def get(self, job_id: str) -> dict[str, Any] | None:
        """The record, read consistently, or ``None``."""
        found = self.client.get_item(
            TableName=self.table, Key={"job_id": dynamo.typed(job_id)}, ConsistentRead=True
        )
        return dynamo.plain_item(found["Item"]) if "Item" in found else None

    def take_over(self, job_id: str, lease_until: float, new_lease_until: float) -> bool:
        """Claim a stalled submission whose lease is ``lease_until``; ``False`` if another
        submitter changed it first."""
        return self._conditional(
            self.client.update_item,
            Key={"job_id": dynamo.typed(job_id)},
            UpdateExpression="SET lease_until = :new",
            ConditionExpression="#s = :submitting AND lease_until = :old",
            ExpressionAttributeNames={"#s": "state"},
            ExpressionAttributeValues=dynamo.item(
                {":new": new_lease_until, ":old": lease_until, ":submitting": SUBMITTING}
            ),
        )

    def mark_submitted(self, job_id: str, fields: dict[str, Any]) -> dict[str, Any]:
        """Record the Batch job; the record is ``SUBMITTED`` from now on."""
        values = {**fields, "state": SUBMITTED}
        names = {f"#f{i}": name for i, name in enumerate(values)}
        result = self.client.update_item(
            TableName=self.table,
            Key={"job_id": dynamo.typed(job_id)},
            UpdateExpression="SET " + ", ".join(f"{n} = :v{n[1:]}" for n in names),
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=dynamo.item(
                {f":v{n[1:]}": values[name] for n, name in names.items()}
            ),
            ReturnValues="ALL_NEW",
        )
        return dynamo.plain_item(result["Attributes"])

    def release(self, job_id: str) -> None:
        """Drop a submission that failed before Batch had a job, so the key can be reused."""
        self._conditional(
            self.client.delete_item,
            Key={"job_id": dynamo.typed(job_id)},
            ConditionExpression="#s = :submitting",
            ExpressionAttributeNames={"#s": "state"},
            ExpressionAttributeValues=dynamo.item({":submitting": SUBMITTING}),
        )
