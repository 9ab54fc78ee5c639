"""An in-memory ``StateStore`` for the unit tier: the same conditions and TTL rules as the
DynamoDB one (``tests/integration/test_state_table.py`` runs one contract over both)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from typing import Any

from spillway.protocol.errors import StateUnavailableError
from spillway.state.table import StoredItem, ttl_value


class MemoryStateStore:
    """Items in a dict; ``down`` makes every call fail as an unreachable table would."""

    def __init__(self) -> None:
        self.items: dict[str, StoredItem] = {}
        self.calls: Counter[str] = Counter()
        self.down = False
        self._lock = threading.Lock()

    def _enter(self, operation: str) -> None:
        self.calls[operation] += 1
        if self.down:
            raise StateUnavailableError("the state table cannot be reached", retry_after_s=1.0)

    def _live(self, key: str, now: float) -> StoredItem | None:
        item = self.items.get(key)
        if item is None or (item.expires_at is not None and item.expires_at <= now):
            return None
        return item

    def _store(
        self, key: str, doc: dict[str, Any], revision: int, expires_at: float | None
    ) -> None:
        # A round trip through JSON, as the table stores documents.
        copied = json.loads(json.dumps(doc, allow_nan=False))
        expires = float(ttl_value(expires_at)) if expires_at is not None else None
        self.items[key] = StoredItem(copied, revision, expires)

    def get(self, key: str, now: float) -> StoredItem | None:
        self._enter("get")
        with self._lock:
            item = self._live(key, now)
            return (
                StoredItem(json.loads(json.dumps(item.doc)), item.revision, item.expires_at)
                if item
                else None
            )

    def create(self, key: str, doc: dict[str, Any], now: float, expires_at: float | None) -> bool:
        self._enter("create")
        with self._lock:
            if self._live(key, now) is not None:
                return False
            self._store(key, doc, 1, expires_at)
            return True

    def replace(
        self, key: str, doc: dict[str, Any], revision: int, expires_at: float | None
    ) -> bool:
        self._enter("replace")
        with self._lock:
            item = self.items.get(key)
            if item is None or item.revision != revision:
                return False
            self._store(key, doc, revision + 1, expires_at)
            return True

    def put(self, key: str, doc: dict[str, Any], expires_at: float | None) -> None:
        self._enter("put")
        with self._lock:
            self._store(key, doc, 1, expires_at)

    def touch(self, key: str, now: float, expires_at: float) -> StoredItem | None:
        self._enter("touch")
        with self._lock:
            item = self._live(key, now)
            if item is None:
                return None
            self.items[key] = StoredItem(item.doc, item.revision, float(ttl_value(expires_at)))
            return self.items[key]

    def delete(self, key: str, now: float) -> bool:
        self._enter("delete")
        with self._lock:
            if self._live(key, now) is None:
                return False
            del self.items[key]
            return True
