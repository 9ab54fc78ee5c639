"""WebSocket connections' state in the router's state table (key ``pk``, TTL ``expires_at``).

One item per connection, ``wsconn#<connectionId>``: its tenant, when it connected, when it
expires, the next ``seq`` to deliver, the delivery lease and the counters (``in_flight``,
``frames_in``, ``frames_answered``, ``frames_failed``, ``frames_refused``, ``bytes_in``,
``bytes_out``, ``cost_usd`` and one ``backend:<name>`` count per backend), every change
an atomic ``ADD``. One item per answer held for ordering, ``wsheld#<connectionId>#<seq>``:
reserved (``pending``) when its frame is admitted, ready once it holds the answer, deleted
when delivered. Every seq held lies in ``[next_seq, next_seq + max_in_flight)``, so closing
a connection deletes that range without a query (the table has no sort key).

API Gateway chooses connection ids (never a tenant), so they are keys as they are, once
checked to be plain. Reads treat an item past its ``expires_at`` as absent, as the other
stores of the table do. A table that cannot be reached is ``StateUnavailableError``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from spillway.protocol.errors import InvalidInputError
from spillway.state.dynamo import conditional, plain_item, typed
from spillway.state.table import (
    KEY,
    TTL_ATTRIBUTE,
    DynamoStateStore,
    StateUnavailableError,
    ttl_value,
)

CONNECTION_PREFIX = "wsconn#"
HELD_PREFIX = "wsheld#"
COUNTERS = (
    "in_flight",
    "frames_in",
    "frames_answered",
    "frames_failed",
    "frames_refused",
    "bytes_in",
    "bytes_out",
    "cost_usd",
)
BACKEND_PREFIX = "backend:"
_CONNECTION_ID = re.compile(r"^[A-Za-z0-9._:=+/-]{1,128}$")
_LIVE = f"attribute_exists({KEY}) AND {TTL_ATTRIBUTE} > :now"
_BATCH = 25  # DynamoDB's BatchWriteItem limit
_PENDING = "pending"
_READY = "ready"


@dataclass(frozen=True)
class Connection:
    """A live connection as its item says."""

    id: str
    tenant: str | None
    connected_at: float
    next_seq: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    backends: dict[str, int] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        """Frames received and not yet answered."""
        return int(self.counters.get("in_flight", 0))

    def stats(self) -> dict[str, Any]:
        """The accounting a client may read about its own connection."""
        counts = {name: _number(self.counters.get(name, 0)) for name in COUNTERS}
        return {"connected_at": self.connected_at, **counts, "backends": dict(self.backends)}


@dataclass(frozen=True)
class Admission:
    """Whether a frame was admitted, and the frames in flight (its own included)."""

    admitted: bool
    in_flight: int


class ConnectionStore(Protocol):
    """Connection items, held answers and the delivery lease; ``now`` is epoch seconds."""

    def open(self, connection_id: str, tenant: str | None, now: float, ttl_s: float) -> None:
        """Write a fresh item (zero counters) for a new connection."""
        ...

    def get(self, connection_id: str, now: float) -> Connection | None:
        """The live connection, read consistently; ``None`` when absent or expired."""
        ...

    def admit(self, connection_id: str, size: int, limit: int, now: float) -> Admission | None:
        """Count a received frame of ``size`` bytes; admit it (``in_flight`` + 1) only
        while fewer than ``limit`` are in flight, else count it refused. ``None``: no
        live connection."""
        ...

    def count(
        self, connection_id: str, deltas: Mapping[str, float], backend: str | None = None
    ) -> None:
        """Add ``deltas`` to counters (and one to ``backend``'s count); nothing when the
        connection is gone."""
        ...

    def reserve(self, connection_id: str, seq: int, owner: str, now: float, ttl_s: float) -> bool:
        """Reserve ``seq`` for ``owner``'s admitted frame; ``False`` when another frame
        holds it (a write retried after it went through is ``owner``'s: ``True``)."""
        ...

    def unreserve(self, connection_id: str, seq: int) -> None:
        """Delete a reservation that is still pending (a duplicate found after it)."""
        ...

    def hold(self, connection_id: str, seq: int, answer: bytes, now: float, ttl_s: float) -> None:
        """Store ``seq``'s answer, ready to deliver."""
        ...

    def held(self, connection_id: str, seq: int, now: float) -> bytes | None:
        """``seq``'s answer when it is ready; ``None`` when absent or still pending."""
        ...

    def claim(self, connection_id: str, seq: int, owner: str, now: float, until: float) -> bool:
        """Take the delivery lease until ``until`` to push ``seq``: only while ``seq`` is
        ``next_seq`` and no other owner holds a lease that is still running (``owner``
        may take its own again, so a retried write is not refused)."""
        ...

    def advance(self, connection_id: str, seq: int, owner: str, now: float, sent: int) -> bool:
        """After ``seq``'s answer was pushed: ``next_seq`` becomes ``seq + 1`` (only from
        ``seq``, only while ``owner`` holds the lease), the lease is given back,
        ``in_flight`` - 1, ``bytes_out`` + ``sent``; then the held answer is deleted.
        ``False`` when ``seq`` was not ``owner``'s to advance."""
        ...

    def release(self, connection_id: str, owner: str) -> None:
        """Give the delivery lease back (only ``owner``'s)."""
        ...

    def close(self, connection_id: str, now: float, window: int) -> Connection | None:
        """Delete the connection's item and every answer held in its window; the
        connection as it was last (``None`` if there was none)."""
        ...


def connection_key(connection_id: str) -> str:
    """The key of a connection's item; an id that is not plain is refused."""
    if not _CONNECTION_ID.fullmatch(connection_id):
        raise InvalidInputError("not a WebSocket connection id")
    return f"{CONNECTION_PREFIX}{connection_id}"


def held_key(connection_id: str, seq: int) -> str:
    """The key of an answer held for ``seq``."""
    connection_key(connection_id)
    return f"{HELD_PREFIX}{connection_id}#{seq}"


class DynamoConnections:
    """``ConnectionStore`` over the state table, through the router's ``DynamoStateStore``
    (its client, made on first use, is shared)."""

    def __init__(self, state: DynamoStateStore) -> None:
        self.state = state
        self.table = state.table

    @property
    def client(self) -> Any:
        """The state table's DynamoDB client."""
        return self.state.client

    def open(self, connection_id: str, tenant: str | None, now: float, ttl_s: float) -> None:
        values: dict[str, Any] = {
            KEY: connection_key(connection_id),
            "connected_at": now,
            TTL_ATTRIBUTE: ttl_value(now + ttl_s),
            "next_seq": 0,
            **dict.fromkeys(COUNTERS, 0),
        }
        if tenant is not None:
            values["tenant"] = tenant
        self._call("put_item", Item={k: typed(v) for k, v in values.items()})

    def get(self, connection_id: str, now: float) -> Connection | None:
        found = self._call("get_item", Key=_key(connection_key(connection_id)), ConsistentRead=True)
        return _connection(connection_id, found.get("Item"), now) if found else None

    def admit(self, connection_id: str, size: int, limit: int, now: float) -> Admission | None:
        key = _key(connection_key(connection_id))
        admitted = self._call(
            "update_item",
            Key=key,
            UpdateExpression="ADD in_flight :one, frames_in :one, bytes_in :size",
            ConditionExpression=f"{_LIVE} AND in_flight < :limit",
            ExpressionAttributeValues=_values(one=1, size=size, limit=limit, now=now),
            ReturnValues="UPDATED_NEW",
        )
        if admitted is not None:
            return Admission(True, int(plain_item(admitted["Attributes"])["in_flight"]))
        refused = self._call(
            "update_item",
            Key=key,
            UpdateExpression="ADD frames_in :one, bytes_in :size, frames_refused :one",
            ConditionExpression=_LIVE,
            ExpressionAttributeValues=_values(one=1, size=size, now=now),
            ReturnValues="ALL_NEW",
        )
        if refused is None:
            return None
        return Admission(False, int(plain_item(refused["Attributes"])["in_flight"]))

    def count(
        self, connection_id: str, deltas: Mapping[str, float], backend: str | None = None
    ) -> None:
        names = {f"#c{i}": name for i, name in enumerate(deltas)}
        values = {f":c{i}": delta for i, delta in enumerate(deltas.values())}
        adds = [f"#c{i} :c{i}" for i in range(len(deltas))]
        if backend:
            names["#b"], values[":one"] = f"{BACKEND_PREFIX}{backend}", 1
            adds.append("#b :one")
        if not adds:
            return
        self._call(
            "update_item",
            Key=_key(connection_key(connection_id)),
            UpdateExpression="ADD " + ", ".join(adds),
            ConditionExpression=f"attribute_exists({KEY})",
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=_values(**{k[1:]: v for k, v in values.items()}),
        )

    def reserve(self, connection_id: str, seq: int, owner: str, now: float, ttl_s: float) -> bool:
        key = held_key(connection_id, seq)
        item = {KEY: key, "state": _PENDING, "owner": owner}
        placed = self._call(
            "put_item",
            Item={**{k: typed(v) for k, v in item.items()}, **_ttl(now + ttl_s)},
            ConditionExpression=f"attribute_not_exists({KEY})",
        )
        if placed is not None:
            return True
        # botocore retries a write whose answer timed out: the item may be this frame's
        found = self._call("get_item", Key=_key(key), ConsistentRead=True)
        values = plain_item((found or {}).get("Item") or {})
        return values.get("state") == _PENDING and values.get("owner") == owner

    def unreserve(self, connection_id: str, seq: int) -> None:
        self._call(
            "delete_item",
            Key=_key(held_key(connection_id, seq)),
            ConditionExpression="#s = :pending",
            ExpressionAttributeNames={"#s": "state"},
            ExpressionAttributeValues=_values(pending=_PENDING),
        )

    def hold(self, connection_id: str, seq: int, answer: bytes, now: float, ttl_s: float) -> None:
        item = {KEY: held_key(connection_id, seq), "state": _READY, "answer": answer}
        self._call("put_item", Item={**{k: typed(v) for k, v in item.items()}, **_ttl(now + ttl_s)})

    def held(self, connection_id: str, seq: int, now: float) -> bytes | None:
        found = self._call("get_item", Key=_key(held_key(connection_id, seq)), ConsistentRead=True)
        values = plain_item(found.get("Item") or {}) if found else {}
        if values.get("state") != _READY or float(values.get(TTL_ATTRIBUTE, 0)) <= now:
            return None
        answer = values.get("answer")
        return answer if isinstance(answer, bytes) else None

    def claim(self, connection_id: str, seq: int, owner: str, now: float, until: float) -> bool:
        return (
            self._call(
                "update_item",
                Key=_key(connection_key(connection_id)),
                UpdateExpression="SET lease_owner = :owner, lease_until = :until",
                ConditionExpression=(
                    f"{_LIVE} AND next_seq = :seq AND (attribute_not_exists(lease_until)"
                    " OR lease_until <= :now OR lease_owner = :owner)"
                ),
                ExpressionAttributeValues=_values(owner=owner, until=until, now=now, seq=seq),
            )
            is not None
        )

    def advance(self, connection_id: str, seq: int, owner: str, now: float, sent: int) -> bool:
        key = _key(connection_key(connection_id))
        moved = self._call(
            "update_item",
            Key=key,
            UpdateExpression=(
                "SET next_seq = :next REMOVE lease_owner, lease_until"
                " ADD in_flight :minus, bytes_out :sent"
            ),
            ConditionExpression=f"{_LIVE} AND next_seq = :seq AND lease_owner = :owner",
            ExpressionAttributeValues=_values(
                next=seq + 1, seq=seq, minus=-1, sent=sent, owner=owner, now=now
            ),
        )
        if moved is None:
            # A retried write whose first try went through: ``next_seq`` is past ``seq``
            # (nobody else may claim ``seq`` while this owner's lease runs).
            found = self._call("get_item", Key=key, ConsistentRead=True)
            values = plain_item((found or {}).get("Item") or {})
            if int(values.get("next_seq", 0)) <= seq:
                return False
        self._call("delete_item", Key=_key(held_key(connection_id, seq)))
        return True

    def release(self, connection_id: str, owner: str) -> None:
        self._call(
            "update_item",
            Key=_key(connection_key(connection_id)),
            UpdateExpression="REMOVE lease_owner, lease_until",
            ConditionExpression="lease_owner = :owner",
            ExpressionAttributeValues=_values(owner=owner),
        )

    def close(self, connection_id: str, now: float, window: int) -> Connection | None:
        gone = self._call(
            "delete_item", Key=_key(connection_key(connection_id)), ReturnValues="ALL_OLD"
        )
        last = _connection(connection_id, (gone or {}).get("Attributes"), -math.inf)
        first = last.next_seq if last is not None else 0
        self._delete_all([held_key(connection_id, s) for s in range(first, first + window)])
        return last

    def _delete_all(self, keys: list[str]) -> None:
        for start in range(0, len(keys), _BATCH):
            requests = [{"DeleteRequest": {"Key": _key(k)}} for k in keys[start : start + _BATCH]]
            for _ in range(5):  # unprocessed items (throttling) are sent again
                answer = self._call("batch_write_item", RequestItems={self.table: requests})
                requests = ((answer or {}).get("UnprocessedItems") or {}).get(self.table) or []
                if not requests:
                    break

    def _call(self, operation: str, **kwargs: Any) -> dict[str, Any] | None:
        """One DynamoDB call on the table; ``None`` when its condition failed."""
        from botocore.exceptions import BotoCoreError, ClientError

        if operation != "batch_write_item":
            kwargs["TableName"] = self.table
        try:
            return conditional(getattr(self.client, operation), **kwargs)
        except (BotoCoreError, ClientError) as exc:
            raise StateUnavailableError(
                f"the state table {self.table} cannot be reached ({type(exc).__name__})",
                retry_after_s=1.0,
            ) from exc


def _key(key: str) -> dict[str, Any]:
    return {KEY: typed(key)}


def _ttl(expires_at: float) -> dict[str, Any]:
    return {TTL_ATTRIBUTE: typed(ttl_value(expires_at))}


def _values(**values: Any) -> dict[str, Any]:
    return {f":{name}": typed(value) for name, value in values.items()}


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else float(value)


def _connection(connection_id: str, item: dict[str, Any] | None, now: float) -> Connection | None:
    if not item:
        return None
    values = plain_item(item)
    if float(values.get(TTL_ATTRIBUTE, 0)) <= now:
        return None
    tenant = values.get("tenant")
    return Connection(
        id=connection_id,
        tenant=tenant if isinstance(tenant, str) else None,
        connected_at=float(values.get("connected_at", 0)),
        next_seq=int(values.get("next_seq", 0)),
        counters={name: float(values.get(name, 0)) for name in COUNTERS},
        backends={
            name.removeprefix(BACKEND_PREFIX): int(value)
            for name, value in values.items()
            if name.startswith(BACKEND_PREFIX)
        },
    )
