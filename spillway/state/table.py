"""The router's shared state: one DynamoDB table that every router instance reads.

One string partition key, ``pk``, whose prefix says what an item is (``canary#<model>``,
``affinity#<scope>#<model>#<session>``, ``session#<scope>#<id>``), a JSON document, a
revision for optimistic writes and an ``expires_at`` attribute (epoch seconds) that is the
table's TTL attribute. DynamoDB deletes expired items lazily (often days later), so every
read here treats an item whose ``expires_at`` has passed as absent: the TTL holds to the
second for readers, and the table's TTL only reclaims the space.

``StateStore`` is what the router, the CLI and the tests program against; ``DynamoStateStore``
is the one implementation (moto locally, DynamoDB on AWS). A failure to reach the table is
an ``UnavailableError`` (503), never a stack trace.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from spillway.aws import clients as aws
from spillway.aws.errors import aws_errors, is_condition_failed
from spillway.protocol.errors import StateUnavailableError
from spillway.state.dynamo import plain, typed

_T = TypeVar("_T")

KEY = "pk"
TTL_ATTRIBUTE = "expires_at"
_DOC = "doc"
_REVISION = "rev"
_LIVE = f"(attribute_not_exists({TTL_ATTRIBUTE}) OR {TTL_ATTRIBUTE} > :now)"


@dataclass(frozen=True)
class StoredItem:
    """A live item: its document, its revision and when it expires (``None``: never)."""

    doc: dict[str, Any]
    revision: int
    expires_at: float | None = None


class StateStore(Protocol):
    """Items by key with optimistic writes and a TTL; ``now`` is epoch seconds."""

    def get(self, key: str, now: float) -> StoredItem | None:
        """The live item, read consistently, or ``None`` (absent or expired)."""
        ...

    def create(self, key: str, doc: dict[str, Any], now: float, expires_at: float | None) -> bool:
        """Write a new item (revision 1) unless a live one exists; whether it was written."""
        ...

    def replace(
        self, key: str, doc: dict[str, Any], revision: int, expires_at: float | None
    ) -> bool:
        """Overwrite the item at ``revision`` (it becomes ``revision + 1``); ``False`` when
        another writer changed it first."""
        ...

    def put(self, key: str, doc: dict[str, Any], expires_at: float | None) -> None:
        """Write the item whatever is there (revision 1)."""
        ...

    def touch(self, key: str, now: float, expires_at: float) -> StoredItem | None:
        """Move a live item's expiry to ``expires_at`` and return it; ``None`` if none."""
        ...

    def delete(self, key: str, now: float) -> bool:
        """Delete the item; whether a live one was there."""
        ...


def scope(tenant: str | None) -> str:
    """The key segment of a caller: a digest of its tenant, so no separator or length in a
    tenant name can reach into another caller's keys (``-`` for an anonymous caller)."""
    if tenant is None:
        return "-"
    return hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def ttl_value(expires_at: float) -> int:
    """The TTL attribute: whole epoch seconds, rounded up (never expiring early)."""
    return math.ceil(expires_at)


class DynamoStateStore:
    """``StateStore`` over a DynamoDB table (created with ``create_table``).

    The client is made on first use (``client_factory``), so a router that never touches
    the table never imports boto3."""

    def __init__(self, table: str, client_factory: Callable[[], Any]) -> None:
        self.table = table
        self._factory = client_factory
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        """The DynamoDB client, made once."""
        with self._lock:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def get(self, key: str, now: float) -> StoredItem | None:
        found = self._call(
            "get_item", Key={KEY: typed(key)}, ConsistentRead=True, TableName=self.table
        )
        return _live(found.get("Item"), now) if found is not None else None

    def create(self, key: str, doc: dict[str, Any], now: float, expires_at: float | None) -> bool:
        return (
            self._call(
                "put_item",
                TableName=self.table,
                Item=_item(key, doc, 1, expires_at),
                ConditionExpression=f"attribute_not_exists({KEY}) OR {TTL_ATTRIBUTE} <= :now",
                ExpressionAttributeValues={":now": typed(now)},
            )
            is not None
        )

    def replace(
        self, key: str, doc: dict[str, Any], revision: int, expires_at: float | None
    ) -> bool:
        return (
            self._call(
                "put_item",
                TableName=self.table,
                Item=_item(key, doc, revision + 1, expires_at),
                ConditionExpression=f"{_REVISION} = :rev",
                ExpressionAttributeValues={":rev": typed(revision)},
            )
            is not None
        )

    def put(self, key: str, doc: dict[str, Any], expires_at: float | None) -> None:
        self._call("put_item", TableName=self.table, Item=_item(key, doc, 1, expires_at))

    def touch(self, key: str, now: float, expires_at: float) -> StoredItem | None:
        answer = self._call(
            "update_item",
            TableName=self.table,
            Key={KEY: typed(key)},
            UpdateExpression=f"SET {TTL_ATTRIBUTE} = :exp",
            ConditionExpression=f"attribute_exists({KEY}) AND {_LIVE}",
            ExpressionAttributeValues={
                ":exp": typed(ttl_value(expires_at)),
                ":now": typed(now),
            },
            ReturnValues="ALL_NEW",
        )
        return _live(answer.get("Attributes"), now) if answer is not None else None

    def delete(self, key: str, now: float) -> bool:
        return (
            self._call(
                "delete_item",
                TableName=self.table,
                Key={KEY: typed(key)},
                ConditionExpression=f"attribute_exists({KEY}) AND {_LIVE}",
                ExpressionAttributeValues={":now": typed(now)},
            )
            is not None
        )

    def _call(self, operation: str, **kwargs: Any) -> dict[str, Any] | None:
        """One DynamoDB call; ``None`` when its condition failed."""
        try:
            answer: dict[str, Any] = getattr(self.client, operation)(**kwargs)
        except aws_errors() as exc:
            if is_condition_failed(exc):
                return None
            raise StateUnavailableError(
                f"the state table {self.table} cannot be reached ({type(exc).__name__})",
                retry_after_s=1.0,
            ) from exc
        return answer


def open_state_store(table: str | None) -> DynamoStateStore | None:
    """The state table ``table`` names (``None``: none); its client is made on first use,
    with short timeouts (it is on the request path) and botocore's standard retries."""
    if not table:
        return None

    def client() -> Any:
        return aws.client(
            "dynamodb",
            connect_timeout=1,
            read_timeout=2,
            max_attempts=3,
            max_pool_connections=64,  # one per thread of a local server's pool
        )

    return DynamoStateStore(table, client)


def reach(client: Any, table: str, how: Callable[..., _T], operation: str, **kwargs: Any) -> _T:
    """``how(client.operation, **kwargs)`` (e.g. ``dynamo.conditional``) on the state
    table ``table``, the client's failures raised as ``StateUnavailableError``."""
    try:
        return how(getattr(client, operation), **kwargs)
    except aws_errors() as exc:
        raise StateUnavailableError(
            f"the state table {table} cannot be reached ({type(exc).__name__})",
            retry_after_s=1.0,
        ) from exc


def _item(key: str, doc: dict[str, Any], revision: int, expires_at: float | None) -> dict[str, Any]:
    item: dict[str, Any] = {
        KEY: typed(key),
        _DOC: typed(json.dumps(doc, separators=(",", ":"), allow_nan=False)),
        _REVISION: typed(revision),
    }
    if expires_at is not None:
        item[TTL_ATTRIBUTE] = typed(ttl_value(expires_at))
    return item


def _live(item: dict[str, Any] | None, now: float) -> StoredItem | None:
    if not item:
        return None
    expires = float(plain(item[TTL_ATTRIBUTE])) if TTL_ATTRIBUTE in item else None
    if expires is not None and expires <= now:
        return None
    return StoredItem(json.loads(plain(item[_DOC])), int(plain(item[_REVISION])), expires)


def create_table(client: Any, table: str) -> None:
    """Create the state table as both templates declare it (key ``pk``, on-demand, TTL on
    ``expires_at``): for the local stack and the tests, on moto."""
    client.create_table(
        TableName=table,
        AttributeDefinitions=[{"AttributeName": KEY, "AttributeType": "S"}],
        KeySchema=[{"AttributeName": KEY, "KeyType": "HASH"}],
        BillingMode="PAY_PER_REQUEST",
    )
    client.get_waiter("table_exists").wait(TableName=table)
    client.update_time_to_live(
        TableName=table,
        TimeToLiveSpecification={"Enabled": True, "AttributeName": TTL_ATTRIBUTE},
    )
