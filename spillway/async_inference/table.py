"""``RecordTable``: asynchronous requests' records in DynamoDB, and the reads of them.

One record by id (``find``: an expired one is gone, as DynamoDB's TTL deletes lazily), a
caller's own (``lookup``, and its result), the live pending ones oldest first through
the sparse ``pending`` index (``pending``, ``oldest_pending_age``), and the expired ones
removed where no TTL runs (``purge_expired``, the local stack). Every transition of a
record (``spillway.async_inference.store``) writes through ``_update``: one conditional
``UpdateItem``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from spillway.async_inference import replies
from spillway.async_inference.objects import AsyncObjects
from spillway.async_inference.queue import AsyncQueue
from spillway.async_inference.records import (
    DONE,
    AsyncRecord,
    check_id,
    from_item,
    owner_scope,
)
from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.states import Lifecycle
from spillway.protocol.errors import RouteNotFoundError
from spillway.protocol.replies import Reply
from spillway.state import dynamo
from spillway.state.table import scope

PENDING_PARTITION = "1"
"""The sparse ``pending`` index's one partition: only pending records carry it."""
_PAGE = 25  # pending index entries read per query
# Attribute names that are DynamoDB reserved words.
_NAMES = {"#s": "state", "#st": "status", "#o": "owner", "#e": "error", "#r": "result"}


def attribute_names(*expressions: str) -> dict[str, str]:
    """The reserved-word placeholders the expressions use (DynamoDB refuses unused ones)."""
    used = set(re.findall(r"#\w+", " ".join(expressions)))
    return {k: v for k, v in _NAMES.items() if k in used}


class RecordTable:
    """The records (DynamoDB), with the bodies and results (S3) and the queue (SQS) the
    transitions use."""

    def __init__(
        self,
        settings: AsyncSettings,
        *,
        clients: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not settings.enabled:
            raise ValueError("async inference needs ASYNC_TABLE, ASYNC_QUEUE_URL, ASYNC_LOCATION")
        self.settings = settings
        self.table = str(settings.table)
        self.queue_url = str(settings.queue_url)
        self._make = clients
        self._clients: dict[str, Any] = {}
        self.clock = clock
        self.objects = AsyncObjects(settings, self.client)
        self.location = self.objects.location
        self.queue = AsyncQueue(self.queue_url, settings.lease_s, settings.topic_arn, self.client)
        self.lifecycle = Lifecycle.of(settings)

    def client(self, service: str) -> Any:
        """The boto3 client of a service (made on first use)."""
        if service not in self._clients:
            if self._make is not None:
                self._clients[service] = self._make(service)
            else:
                from spillway.aws.clients import aws_client

                self._clients[service] = aws_client(service)
        return self._clients[service]

    def _update(
        self, rid: str, update: str, condition: str, **values: Any
    ) -> dict[str, Any] | None:
        """One conditional ``UpdateItem`` of a record (``values`` by placeholder name,
        without its colon); the new record's attributes, or None when the condition did
        not hold."""
        return dynamo.conditional(
            self.client("dynamodb").update_item,
            TableName=self.table,
            Key=dynamo.item({"id": rid}),
            UpdateExpression=update,
            ConditionExpression=condition,
            ExpressionAttributeNames=attribute_names(update, condition),
            ExpressionAttributeValues=dynamo.item({f":{k}": v for k, v in values.items()}),
            ReturnValues="ALL_NEW",
        )

    # --- one record -------------------------------------------------------------------

    def still_pending(self, rid: str) -> bool:
        """Whether a request is queued or running (not settled, expired or unknown)."""
        record = self.find(rid)
        return record is not None and record.state not in DONE

    def find(self, rid: str) -> AsyncRecord | None:
        """The record of a request id, or None (also when it has expired)."""
        answer = self.client("dynamodb").get_item(
            TableName=self.table, Key=dynamo.item({"id": rid}), ConsistentRead=True
        )
        item = answer.get("Item")
        if not item:
            return None
        record = from_item(item)
        return None if record.expires_at < self.clock() else record

    def lookup(self, rid: str, tenant: str | None) -> AsyncRecord:
        """A caller's own request; another caller's, an expired or unknown one is 404."""
        record = self.find(check_id(rid))
        if record is None or owner_scope(record) != scope(tenant):
            raise RouteNotFoundError("no such asynchronous request (or it has expired)")
        return record

    def result_reply(self, rid: str, tenant: str | None) -> Reply:
        """``GET /v1/results/{id}`` (``replies.result_reply`` of the caller's own record)."""
        return replies.result_reply(self.lookup(rid, tenant), self.objects.read)

    def result_url(self, rid: str) -> str | None:
        """The S3 URL of a request's visible result (None: none yet)."""
        record = self.find(check_id(rid))
        return None if record is None else record.result

    # --- queue age and expiry ---------------------------------------------------------

    def pending(self, limit: int = 100) -> Iterator[AsyncRecord]:
        """Live queued or running requests, oldest first, at most ``limit`` of them.

        The sparse ``pending`` index (only pending records carry its key; it projects
        keys only) is read from ``now - ttl_s`` on, so the records DynamoDB's TTL has not
        deleted yet (it takes up to days) cost nothing; each candidate is then read from
        the table, which also skips one that expired or settled meanwhile. An expired
        record is nobody's backlog: nobody can read its result."""
        since = self.clock() - self.settings.ttl_s
        query: dict[str, Any] = {
            "TableName": self.table,
            "IndexName": "pending",
            "KeyConditionExpression": "pending = :p AND created_at >= :since",
            "ExpressionAttributeValues": dynamo.item({":p": PENDING_PARTITION, ":since": since}),
            "ScanIndexForward": True,
            "Limit": _PAGE,
        }
        seen = 0
        while True:
            answer = self.client("dynamodb").query(**query)
            for item in answer.get("Items") or []:
                record = self.find(str(dynamo.plain(item["id"])))
                if record is None or record.state in DONE:
                    continue
                yield record
                seen += 1
                if seen >= limit:
                    return
            if "LastEvaluatedKey" not in answer:
                return
            query["ExclusiveStartKey"] = answer["LastEvaluatedKey"]

    def oldest_pending_age(self) -> float | None:
        """Seconds the oldest live queued or running request has waited (None: none)."""
        oldest = next(self.pending(1), None)
        return None if oldest is None else max(0.0, self.clock() - oldest.created_at)

    def queue_is_empty(self) -> bool:
        """Whether the queue holds no message at all (``AsyncQueue.is_empty``)."""
        return self.queue.is_empty()

    def purge_expired(self, limit: int = 100) -> int:
        """Delete expired records and their objects (what DynamoDB's TTL and the S3
        lifecycle rule do on AWS); how many were removed."""
        answer = self.client("dynamodb").scan(
            TableName=self.table,
            FilterExpression="expires_at < :now",
            ExpressionAttributeValues=dynamo.item({":now": self.clock()}),
            Limit=max(limit, 1) * 10,
        )
        removed = 0
        for item in answer.get("Items", [])[:limit]:
            record = from_item(item)
            self.objects.delete_own(record)
            self.client("dynamodb").delete_item(
                TableName=self.table, Key=dynamo.item({"id": record.id})
            )
            removed += 1
        return removed
