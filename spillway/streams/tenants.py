"""A tenant's share of the WebSocket API, kept in the router's state table: its open
connections, its frames being served and its frame rate.

API Gateway's WebSocket throttling is per stage or route, for every client at once
(https://docs.aws.amazon.com/apigateway/latest/developerguide/websocket-api-protect.html),
and WebSocket APIs have no usage plans or API keys: nothing in front of the function tells
one tenant from another. So the function refuses a tenant's excess itself, with one
conditional write, before the frame is routed. Two items a tenant, keyed by a digest of
its name (``scope``), so no character of a tenant name reaches into a key:

- ``wstenant#<scope>#connections``: ``conns``, a map from each open connection's id to
  when its entry lapses (API Gateway closes every connection after 2 hours, so an entry
  whose ``$disconnect`` never came lapses a little after that); a ``$connect`` over the
  cap first drops entries that lapsed or whose connection item is gone, then refuses.
- ``wstenant#<scope>#frames``: ``slots``, a map from each frame being served to when it
  was admitted (an entry older than ``SLOT_STALE_S``, left by an invocation that died, is
  dropped when the map is full), and ``tat``, the theoretical arrival time of the
  generic cell rate algorithm: a frame at ``now`` fits the rate while ``max(tat, now)``
  is at most ``(burst - 1) / rate`` ahead of ``now``, and moves it ``1 / rate`` on.

A table that cannot be reached is ``StateUnavailableError``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from spillway.protocol.errors import StateUnavailableError
from spillway.state.dynamo import conditional, conditional_or_old, plain_item, typed
from spillway.state.table import KEY, DynamoStateStore, reach, scope
from spillway.streams.connections import connection_key

TENANT_PREFIX = "wstenant#"
SLOT_STALE_S = 120.0
"""A frame slot older than this was left by an invocation that died: API Gateway stops
waiting for an integration after 29 s and the function's own timeout is shorter than this."""
CONNECTION_LIFE_S = 2 * 3600 + 300
"""How long a connection's entry counts without a ``$disconnect``: API Gateway closes every
connection after 2 hours
(https://docs.aws.amazon.com/apigateway/latest/developerguide/apigateway-execution-service-websocket-limits-table.html),
plus a margin for a ``$disconnect`` on its way."""
PROBE_EVERY_S = 10.0
"""How often (per tenant and function instance) a ``$connect`` at the cap reads the
tenant's connection items to find those closed without a ``$disconnect``."""
IN_FLIGHT, RATE = "tenant_in_flight", "tenant_rate"
_TRIES = 4
_BATCH_GET = 100  # DynamoDB's BatchGetItem limit
_T = TypeVar("_T")


@dataclass(frozen=True)
class FrameAdmission:
    """A frame's place in its tenant's budget: ``refusal`` is ``None`` (admitted),
    ``tenant_in_flight`` or ``tenant_rate``; ``in_flight`` counts the tenant's frames being
    served (this one's included when admitted); ``retry_after_s`` when over the rate."""

    refusal: str | None
    in_flight: int
    retry_after_s: float = 0.0


class TenantBudgets(Protocol):
    """A tenant's connections and frames being served; ``now`` is epoch seconds."""

    def connect(self, tenant: str | None, connection_id: str, now: float, cap: int) -> bool:
        """Count the connection in, while the tenant has fewer than ``cap``; ``False``:
        refused (entries that lapsed, or whose connection is gone, are dropped first)."""
        ...

    def disconnect(self, tenant: str | None, connection_id: str) -> None:
        """Count the connection out (nothing when it was not counted)."""
        ...

    def admit(
        self, tenant: str | None, token: str, now: float, limit: int, rate: float, burst: int
    ) -> FrameAdmission:
        """Count a frame in under ``token`` while fewer than ``limit`` of the tenant's are
        being served and the frame fits ``rate`` frames/s with bursts of ``burst``."""
        ...

    def release(self, tenant: str | None, token: str) -> None:
        """Count the frame of ``token`` out."""
        ...


def tenant_key(tenant: str | None, what: str) -> str:
    """The key of a tenant's ``connections`` or ``frames`` item."""
    return f"{TENANT_PREFIX}{scope(tenant)}#{what}"


def frame_token() -> str:
    """A frame's slot name: random, short (the map is written with every frame)."""
    return os.urandom(6).hex()


class DynamoTenantBudgets:
    """``TenantBudgets`` over the state table, through the router's ``DynamoStateStore``."""

    def __init__(
        self, state: DynamoStateStore, elapsed: Callable[[], float] = time.monotonic
    ) -> None:
        self.state = state
        self.elapsed = elapsed
        """A monotonic clock: how long an admission's writes have taken (tests pass one
        that stands still, or moves as they say)."""
        self.table = state.table
        self._ahead: dict[str | None, float] = {}
        self._probed: dict[str, float] = {}
        """When each tenant's connection items were last read for ones that are gone."""
        """The last ``tat`` seen of each tenant, to pick the write that usually holds."""

    # --- connections -------------------------------------------------------------------

    def connect(self, tenant: str | None, connection_id: str, now: float, cap: int) -> bool:
        key = tenant_key(tenant, "connections")
        names = {"#conns": "conns", "#id": connection_id}
        for _ in range(_TRIES):
            written, old = self._write_or_old(
                Key=_key(key),
                UpdateExpression="SET #conns.#id = :until",
                ConditionExpression=(
                    "attribute_exists(#conns) AND (size(#conns) < :cap"
                    " OR attribute_exists(#conns.#id))"
                ),
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=_values(until=now + CONNECTION_LIFE_S, cap=cap),
            )
            if written is not None:
                return True
            conns = _map(old, "conns")
            if conns is None:
                self._create(key, {"conns": {connection_id: now + CONNECTION_LIFE_S}})
                continue
            stale = self._stale_connections(key, conns, now)
            if not stale:
                return False
            self._remove(key, "conns", stale)
        raise StateUnavailableError(
            "the tenant's connections could not be counted", retry_after_s=1.0
        )

    def disconnect(self, tenant: str | None, connection_id: str) -> None:
        self._forget(tenant_key(tenant, "connections"), "conns", connection_id)

    def _stale_connections(self, key: str, conns: dict[str, float], now: float) -> list[str]:
        """Entries that lapsed, and those whose connection item is gone (closed, or a
        push met 410 Gone)."""
        stale = [c for c, until in conns.items() if until <= now]
        live = [c for c in conns if c not in stale]
        if stale or self._probed.get(key, -math.inf) > now - PROBE_EVERY_S:
            return stale  # a client at its cap cannot make every $connect read them all
        self._probed[key] = now
        for start in range(0, len(live), _BATCH_GET):
            chunk = live[start : start + _BATCH_GET]
            keys = [_key(connection_key(c)) for c in chunk]
            answer = self._call(
                "batch_get_item",
                RequestItems={
                    self.table: {"Keys": keys, "ConsistentRead": True, "ProjectionExpression": KEY}
                },
            )
            found = {
                plain_item(i)[KEY]
                for i in ((answer or {}).get("Responses") or {}).get(self.table, [])
            }
            unread = ((answer or {}).get("UnprocessedKeys") or {}).get(self.table) or {}
            unread_keys = {plain_item(k)[KEY] for k in unread.get("Keys", [])}
            stale += [c for c in chunk if connection_key(c) not in found | unread_keys]
        return stale

    # --- frames ------------------------------------------------------------------------

    def admit(
        self, tenant: str | None, token: str, now: float, limit: int, rate: float, burst: int
    ) -> FrameAdmission:
        key = tenant_key(tenant, "frames")
        interval, tolerance = 1.0 / rate, (burst - 1) / rate
        started = self.elapsed()
        busy = self._ahead.get(tenant, 0.0) > now
        for _ in range(_TRIES):
            # Over the rate is judged at each write's own time (``at``): a frame whose
            # write waited on the table (seconds, under load) while newer frames moved
            # ``tat`` on is not over the rate for having read the clock early. Which write
            # to try is decided against the time it was read (``now``), so that while
            # frames come faster than the rate every write moves ``tat`` on by one step
            # and concurrent writes never undo each other's condition.
            at = now + (self.elapsed() - started)
            written, old = self._write_or_old(
                Key=_key(key),
                UpdateExpression="SET #slots.#t = :now, "
                + ("tat = tat + :step" if busy else "tat = :next"),
                ConditionExpression="attribute_exists(#slots) AND size(#slots) < :limit AND "
                + ("tat > :now AND tat <= :edge" if busy else "tat <= :now"),
                ExpressionAttributeNames={"#slots": "slots", "#t": token},
                ExpressionAttributeValues=_values(
                    now=now,
                    limit=limit,
                    **(
                        {"step": interval, "edge": at + tolerance}
                        if busy
                        else {"next": now + interval}
                    ),
                ),
                ReturnValues="ALL_NEW",
            )
            if written is not None:
                after = plain_item(written["Attributes"])
                self._remember(tenant, float(after.get("tat", 0)))
                return FrameAdmission(None, len(after.get("slots") or {}))
            slots = _map(old, "slots")
            if slots is None:
                self._create(key, {"slots": {token: now}, "tat": now + interval})
                self._remember(tenant, now + interval)
                return FrameAdmission(None, 1)
            tat = float(plain_item(old or {}).get("tat", 0))
            self._remember(tenant, tat)
            if len(slots) >= limit:
                stale = [t for t, admitted in slots.items() if admitted <= now - SLOT_STALE_S]
                if not stale:
                    return FrameAdmission(IN_FLIGHT, len(slots))
                self._remove(key, "slots", stale)
            elif tat > at + tolerance:
                return FrameAdmission(RATE, len(slots), retry_after_s=tat - tolerance - at)
            busy = tat > now
        raise StateUnavailableError("the tenant's frame could not be counted", retry_after_s=1.0)

    def release(self, tenant: str | None, token: str) -> None:
        self._forget(tenant_key(tenant, "frames"), "slots", token)

    def _forget(self, key: str, attribute: str, entry: str) -> None:
        """Remove ``entry`` from the map ``attribute`` of the tenant item ``key`` (an item
        that is not there is left so)."""
        self._call(
            "update_item",
            Key=_key(key),
            UpdateExpression="REMOVE #m.#e",
            ConditionExpression=f"attribute_exists({KEY})",
            ExpressionAttributeNames={"#m": attribute, "#e": entry},
        )

    def _remember(self, tenant: str | None, tat: float) -> None:
        if len(self._ahead) >= 1024:
            self._ahead.clear()
            self._probed.clear()
        self._ahead[tenant] = tat

    # --- the table ---------------------------------------------------------------------

    def _create(self, key: str, values: dict[str, Any]) -> None:
        """The tenant's item, unless another invocation just wrote it (then the caller's
        next try meets that one)."""
        item = {KEY: typed(key), **{name: _typed(value) for name, value in values.items()}}
        self._call("put_item", Item=item, ConditionExpression=f"attribute_not_exists({KEY})")

    def _remove(self, key: str, attribute: str, entries: list[str]) -> None:
        names = {"#m": attribute, **{f"#e{i}": e for i, e in enumerate(entries)}}
        self._call(
            "update_item",
            Key=_key(key),
            UpdateExpression="REMOVE " + ", ".join(f"#m.#e{i}" for i in range(len(entries))),
            ExpressionAttributeNames=names,
        )

    def _write_or_old(self, **kwargs: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        return self._reach(conditional_or_old, "update_item", TableName=self.table, **kwargs)

    def _call(self, operation: str, **kwargs: Any) -> dict[str, Any] | None:
        if operation != "batch_get_item":
            kwargs["TableName"] = self.table
        return self._reach(conditional, operation, **kwargs)

    def _reach(self, how: Callable[..., _T], operation: str, **kwargs: Any) -> _T:
        return reach(self.state.client, self.table, how, operation, **kwargs)


def _key(key: str) -> dict[str, Any]:
    return {KEY: typed(key)}


def _typed(value: Any) -> dict[str, Any]:
    """``typed``, a map's numbers included (boto3 takes no ``float`` inside a map)."""
    if isinstance(value, dict):
        return {"M": {str(name): _typed(inner) for name, inner in value.items()}}
    return typed(value)


def _values(**values: Any) -> dict[str, Any]:
    return {f":{name}": typed(value) for name, value in values.items()}


def _map(item: dict[str, Any] | None, attribute: str) -> dict[str, float] | None:
    """A map attribute of a typed item as names to numbers; ``None`` when absent."""
    value = plain_item(item or {}).get(attribute)
    if not isinstance(value, dict):
        return None
    return {str(name): float(number) for name, number in value.items()}
