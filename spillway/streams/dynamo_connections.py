"""WebSocket connections' state in the router's state table (key ``pk``, TTL ``expires_at``).

One item per connection, ``wsconn#<connectionId>``: its tenant, when it connected, when it
expires, the next ``seq`` to deliver, the delivery lease, the counters (``in_flight``,
``frames_in``, ``frames_answered``, ``frames_failed``, ``frames_refused``, ``bytes_in``,
``bytes_out``, ``cost_usd`` and one ``backend:<name>`` count per backend), every change
an atomic ``ADD``, and ``pending``: a map from each ``seq`` in flight to its frame's token
(or ``held`` once its answer waits for its turn). A frame is admitted by one conditional
write (the bound, the ``seq`` window, the ``seq`` not already in flight or delivered); an
answer whose ``seq`` is next is pushed under a claim of the lease and settled by one more
(``next_seq`` advanced, the lease given back, the counters added), whose result says
whether the next answer is held. One item per held answer, ``wsheld#<connectionId>#<seq>``,
deleted once delivered. Every seq held lies in ``[next_seq, next_seq + max_in_flight)``,
so closing a connection deletes that range without a query (the table has no sort key).

A write botocore sends again after its first try went through (its answer timed out) is
recognised as the caller's own: an admission by its frame's token, a claim by its owner,
a finish by ``next_seq`` already past its ``seq``.

Reads treat an item past its ``expires_at`` as absent, as the other stores of the table
do. A table that cannot be reached is ``StateUnavailableError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from spillway.protocol.errors import StateUnavailableError
from spillway.state.dynamo import conditional, conditional_or_old, plain_item, typed
from spillway.state.table import (
    KEY,
    TTL_ATTRIBUTE,
    DynamoStateStore,
    reach,
    ttl_value,
)
from spillway.streams.connections import (
    COUNTERS,
    HELD,
    Admission,
    Connection,
    connection_key,
    held_key,
)

BACKEND_PREFIX = "backend:"
_LIVE = f"attribute_exists({KEY}) AND {TTL_ATTRIBUTE} > :now"
_BATCH = 25  # DynamoDB's BatchWriteItem limit
_ADMIT_TRIES = 3
_T = TypeVar("_T")


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
            "pending": {},
            **dict.fromkeys(COUNTERS, 0),
        }
        if tenant is not None:
            values["tenant"] = tenant
        self._call("put_item", Item={k: typed(v) for k, v in values.items()})

    def get(self, connection_id: str, now: float) -> Connection | None:
        found = self._call("get_item", Key=_key(connection_key(connection_id)), ConsistentRead=True)
        return _connection(connection_id, found.get("Item"), now) if found else None

    def admit(
        self,
        connection_id: str,
        size: int,
        limit: int,
        now: float,
        seq: int | None = None,
        token: str = "",
    ) -> Admission | None:
        key = _key(connection_key(connection_id))
        condition = f"{_LIVE} AND in_flight < :limit"
        update = "ADD in_flight :one, frames_in :one, bytes_in :size"
        names: dict[str, str] = {}
        values: dict[str, Any] = {"one": 1, "size": size, "limit": limit, "now": now}
        if seq is not None:  # the frame held answers wait for passes the bound (refusal)
            update = f"SET #pending.#seq = :token {update}"
            condition = (
                f"{_LIVE} AND (in_flight < :limit OR next_seq = :seq)"
                " AND next_seq <= :seq AND next_seq > :low AND attribute_not_exists(#pending.#seq)"
            )
            names = {"#pending": "pending", "#seq": str(seq)}
            values.update(token=token, seq=seq, low=seq - limit)
        for _ in range(_ADMIT_TRIES):
            admitted, seen = self._write_or_old(
                "update_item",
                Key=key,
                UpdateExpression=update,
                ConditionExpression=condition,
                ExpressionAttributeValues=_values(**values),
                ReturnValues="ALL_NEW",
                **({"ExpressionAttributeNames": names} if names else {}),
            )
            if admitted is not None:
                return Admission(_alive(connection_id, admitted["Attributes"]))
            # why the write was refused, from the item its condition saw: a read made now
            # could find a frame finished since, and another admitted before the next try
            connection = _connection(connection_id, seen, now) if seen else None
            if connection is None:
                return None
            if seq is not None and connection.pending.get(seq) == token:
                return Admission(connection)  # this frame's own write, retried
            refusal = connection.refusal(seq, limit)
            if refusal is not None:
                refused = {"frames_in": 1, "bytes_in": size, "frames_refused": 1}
                self.count(connection_id, refused)
                return Admission(connection, refusal)
        raise StateUnavailableError(
            "the state table refused the frame's admission without saying why", retry_after_s=1.0
        )

    def count(
        self, connection_id: str, deltas: Mapping[str, float], backend: str | None = None
    ) -> None:
        adds, names, values = _adds(deltas, backend)
        if not adds:
            return
        self._call(
            "update_item",
            Key=_key(connection_key(connection_id)),
            UpdateExpression="ADD " + ", ".join(adds),
            ConditionExpression=f"attribute_exists({KEY})",
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=_values(**values),
        )

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

    def finish(
        self,
        connection_id: str,
        seq: int,
        owner: str,
        now: float,
        deltas: Mapping[str, float],
        backend: str | None = None,
        *,
        held: bool = True,
    ) -> Connection | None:
        key = _key(connection_key(connection_id))
        adds, names, values = _adds({"in_flight": -1, **deltas}, backend)
        names.update({"#pending": "pending", "#seq": str(seq)})
        finished = self._call(
            "update_item",
            Key=key,
            UpdateExpression=(
                "SET next_seq = :next REMOVE lease_owner, lease_until, #pending.#seq"
                " ADD " + ", ".join(adds)
            ),
            ConditionExpression=f"{_LIVE} AND next_seq = :seq AND lease_owner = :owner",
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=_values(
                **values, next=seq + 1, seq=seq, owner=owner, now=now
            ),
            ReturnValues="ALL_NEW",
        )
        if finished is not None:
            after: Connection | None = _alive(connection_id, finished["Attributes"])
        else:
            # A retried write whose first try went through: ``next_seq`` is past ``seq``
            # (nobody else may claim ``seq`` while this owner's lease runs).
            after = self.get(connection_id, now)
            if after is None or after.next_seq <= seq:
                return None
        if held:
            self._call("delete_item", Key=_key(held_key(connection_id, seq)))
        return after

    def hold(
        self,
        connection_id: str,
        seq: int,
        answer: bytes,
        now: float,
        ttl_s: float,
        deltas: Mapping[str, float],
        backend: str | None = None,
    ) -> Connection | None:
        item = {KEY: held_key(connection_id, seq), "answer": answer}
        self._call("put_item", Item={**{k: typed(v) for k, v in item.items()}, **_ttl(now + ttl_s)})
        adds, names, values = _adds(deltas, backend)
        names.update({"#pending": "pending", "#seq": str(seq)})
        marked = self._call(
            "update_item",
            Key=_key(connection_key(connection_id)),
            UpdateExpression="SET #pending.#seq = :held"
            + (" ADD " + ", ".join(adds) if adds else ""),
            ConditionExpression=f"attribute_exists({KEY})",
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=_values(**values, held=HELD),
            ReturnValues="ALL_NEW",
        )
        return None if marked is None else _connection(connection_id, marked["Attributes"], now)

    def held(self, connection_id: str, seq: int, now: float) -> bytes | None:
        found = self._call("get_item", Key=_key(held_key(connection_id, seq)), ConsistentRead=True)
        values = plain_item(found.get("Item") or {}) if found else {}
        if float(values.get(TTL_ATTRIBUTE, 0)) <= now:
            return None
        answer = values.get("answer")
        return answer if isinstance(answer, bytes) else None

    def release(self, connection_id: str, owner: str) -> None:
        self._call(
            "update_item",
            Key=_key(connection_key(connection_id)),
            UpdateExpression="REMOVE lease_owner, lease_until",
            ConditionExpression="lease_owner = :owner",
            ExpressionAttributeValues=_values(owner=owner),
        )

    def withdraw(self, connection_id: str, seq: int | None) -> None:
        names = {"#pending": "pending", "#seq": str(seq)} if seq is not None else {}
        self._call(
            "update_item",
            Key=_key(connection_key(connection_id)),
            UpdateExpression=("REMOVE #pending.#seq " if seq is not None else "")
            + "ADD in_flight :minus, frames_refused :one",
            ConditionExpression=f"attribute_exists({KEY})"
            + (" AND attribute_exists(#pending.#seq)" if seq is not None else ""),
            ExpressionAttributeValues=_values(minus=-1, one=1),
            **({"ExpressionAttributeNames": names} if names else {}),
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
        if operation != "batch_write_item":
            kwargs["TableName"] = self.table
        return self._reach(conditional, operation, **kwargs)

    def _write_or_old(
        self, operation: str, **kwargs: Any
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """One conditional write on the table: ``(answer, None)``, or ``(None, the item its
        condition failed on)``."""
        return self._reach(conditional_or_old, operation, TableName=self.table, **kwargs)

    def _reach(self, how: Callable[..., _T], operation: str, **kwargs: Any) -> _T:
        return reach(self.client, self.table, how, operation, **kwargs)


def _key(key: str) -> dict[str, Any]:
    return {KEY: typed(key)}


def _ttl(expires_at: float) -> dict[str, Any]:
    return {TTL_ATTRIBUTE: typed(ttl_value(expires_at))}


def _values(**values: Any) -> dict[str, Any]:
    return {f":{name}": typed(value) for name, value in values.items()}


def _adds(
    deltas: Mapping[str, float], backend: str | None
) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """``ADD`` clauses of counter deltas (and one to ``backend``'s count): the clauses,
    their names and values."""
    names = {f"#c{i}": name for i, name in enumerate(deltas)}
    values: dict[str, Any] = {f"c{i}": delta for i, delta in enumerate(deltas.values())}
    adds = [f"#c{i} :c{i}" for i in range(len(deltas))]
    if backend:
        names["#b"], values["b"] = f"{BACKEND_PREFIX}{backend}", 1
        adds.append("#b :b")
    return adds, names, values


def _alive(connection_id: str, item: dict[str, Any]) -> Connection:
    """A connection item a write that required it live returned."""
    connection = _connection(connection_id, item, -math.inf)
    if connection is None:
        raise StateUnavailableError("the state table answered an empty item", retry_after_s=1.0)
    return connection


def _connection(connection_id: str, item: dict[str, Any] | None, now: float) -> Connection | None:
    if not item:
        return None
    values = plain_item(item)
    if float(values.get(TTL_ATTRIBUTE, 0)) <= now:
        return None
    tenant, owner = values.get("tenant"), values.get("lease_owner")
    pending = values.get("pending")
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
        pending={int(k): str(v) for k, v in pending.items()} if isinstance(pending, dict) else {},
        lease_owner=owner if isinstance(owner, str) else None,
        lease_until=float(values.get("lease_until", 0)),
    )
