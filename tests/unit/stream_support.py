"""In-memory stand-ins for the WebSocket gateway's parts: a connection store with the
DynamoDB store's conditions (every operation atomic under one lock), a poster that records
what it pushed, and API Gateway WebSocket events."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spillway.streams.connections import COUNTERS, HELD, Admission, Connection, connection_key
from spillway.streams.delivery import ConnectionGone

ENDPOINT = "http://127.0.0.1:1"


@dataclass
class _Item:
    tenant: str | None
    connected_at: float
    expires_at: float
    next_seq: int = 0
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    backends: dict[str, int] = field(default_factory=dict)
    pending: dict[int, str] = field(default_factory=dict)
    lease_owner: str | None = None
    lease_until: float = 0.0

    def add(self, deltas: Mapping[str, float], backend: str | None) -> None:
        for name, delta in deltas.items():
            self.counters[name] += delta
        if backend:
            self.backends[backend] = self.backends.get(backend, 0) + 1


class MemoryConnections:
    """``ConnectionStore`` in memory."""

    def __init__(self) -> None:
        self.items: dict[str, _Item] = {}
        self.held_items: dict[tuple[str, int], bytes] = {}
        self.lock = threading.Lock()

    def _live(self, connection_id: str, now: float) -> _Item | None:
        item = self.items.get(connection_id)
        return item if item is not None and item.expires_at > now else None

    def open(self, connection_id: str, tenant: str | None, now: float, ttl_s: float) -> None:
        connection_key(connection_id)
        with self.lock:
            self.items[connection_id] = _Item(tenant, now, now + ttl_s)

    def get(self, connection_id: str, now: float) -> Connection | None:
        with self.lock:
            item = self._live(connection_id, now)
            return None if item is None else _snapshot(connection_id, item)

    def admit(
        self,
        connection_id: str,
        size: int,
        limit: int,
        now: float,
        seq: int | None = None,
        token: str = "",
    ) -> Admission | None:
        with self.lock:
            item = self._live(connection_id, now)
            if item is None:
                return None
            if seq is not None and item.pending.get(seq) == token:
                return Admission(_snapshot(connection_id, item))  # its own write, retried
            item.counters["frames_in"] += 1
            item.counters["bytes_in"] += size
            refusal = _snapshot(connection_id, item).refusal(seq, limit)
            if refusal is not None:
                item.counters["frames_refused"] += 1
                return Admission(_snapshot(connection_id, item), refusal)
            item.counters["in_flight"] += 1
            if seq is not None:
                item.pending[seq] = token
            return Admission(_snapshot(connection_id, item))

    def count(
        self, connection_id: str, deltas: Mapping[str, float], backend: str | None = None
    ) -> None:
        with self.lock:
            item = self.items.get(connection_id)
            if item is not None:
                item.add(deltas, backend)

    def claim(self, connection_id: str, seq: int, owner: str, now: float, until: float) -> bool:
        with self.lock:
            item = self._live(connection_id, now)
            if item is None or item.next_seq != seq:
                return False
            if item.lease_owner not in (None, owner) and item.lease_until > now:
                return False
            item.lease_owner, item.lease_until = owner, until
            return True

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
        with self.lock:
            item = self._live(connection_id, now)
            if item is None:
                return None
            if item.next_seq > seq:  # its own write, retried (as the DynamoDB store reads it)
                return _snapshot(connection_id, item)
            if item.next_seq != seq or item.lease_owner != owner:
                return None
            item.next_seq, item.lease_owner, item.lease_until = seq + 1, None, 0.0
            item.pending.pop(seq, None)
            item.add({"in_flight": -1, **deltas}, backend)
            self.held_items.pop((connection_id, seq), None)
            return _snapshot(connection_id, item)

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
        with self.lock:
            self.held_items[(connection_id, seq)] = answer
            item = self.items.get(connection_id)
            if item is None:
                return None
            item.pending[seq] = HELD
            item.add(deltas, backend)
            return _snapshot(connection_id, item)

    def held(self, connection_id: str, seq: int, now: float) -> bytes | None:
        with self.lock:
            return self.held_items.get((connection_id, seq))

    def release(self, connection_id: str, owner: str) -> None:
        with self.lock:
            item = self.items.get(connection_id)
            if item is not None and item.lease_owner == owner:
                item.lease_owner, item.lease_until = None, 0.0

    def withdraw(self, connection_id: str, seq: int | None) -> None:
        with self.lock:
            item = self.items.get(connection_id)
            if item is not None and (seq is None or seq in item.pending):
                if seq is not None:
                    del item.pending[seq]
                item.add({"in_flight": -1, "frames_refused": 1}, None)

    def close(self, connection_id: str, now: float, window: int) -> Connection | None:
        with self.lock:
            item = self.items.pop(connection_id, None)
            first = item.next_seq if item is not None else 0
            for seq in range(first, first + window):
                self.held_items.pop((connection_id, seq), None)
            return None if item is None else _snapshot(connection_id, item)


def _snapshot(connection_id: str, item: _Item) -> Connection:
    return Connection(
        connection_id,
        item.tenant,
        item.connected_at,
        item.next_seq,
        dict(item.counters),
        dict(item.backends),
        dict(item.pending),
        item.lease_owner,
        item.lease_until,
    )


class MemoryPoster:
    """Records every pushed answer per connection; a connection in ``gone`` is 410."""

    def __init__(self) -> None:
        self.pushed: dict[str, list[dict[str, Any]]] = {}
        self.gone: set[str] = set()
        self.lock = threading.Lock()

    def post(self, endpoint: str, connection_id: str, data: bytes) -> None:
        assert endpoint == ENDPOINT
        with self.lock:
            if connection_id in self.gone:
                raise ConnectionGone(connection_id)
            self.pushed.setdefault(connection_id, []).append(json.loads(data))

    def answers(self, connection_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.pushed.get(connection_id, []))


def ws_event(
    route: str,
    connection_id: str,
    body: str | None = None,
    *,
    binary: bool = False,
    headers: dict[str, str] | None = None,
    api_key_id: str | None = None,
) -> dict[str, Any]:
    """An API Gateway WebSocket event (``$connect`` carries headers and identity)."""
    context: dict[str, Any] = {
        "routeKey": route,
        "eventType": {"$connect": "CONNECT", "$disconnect": "DISCONNECT"}.get(route, "MESSAGE"),
        "connectionId": connection_id,
        "requestId": f"req-{connection_id}",
        "domainName": "abc.execute-api.us-east-1.amazonaws.com",
        "stage": "prod",
        "identity": {"apiKeyId": api_key_id, "sourceIp": "127.0.0.1"},
    }
    event: dict[str, Any] = {"requestContext": context, "isBase64Encoded": binary}
    if headers is not None:
        event["headers"] = headers
    if body is not None:
        event["body"] = body
    return event


def text(**frame: Any) -> str:
    """A text frame."""
    return json.dumps(frame)
