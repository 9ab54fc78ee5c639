"""Session state: ``PUT/GET/DELETE /v1/sessions/{id}`` keeps a small JSON object per session.

A caller stores up to ``MAX_SESSION_BYTES`` of JSON (an object) under an id of its
choosing; the item lives ``session_ttl_s`` (15 minutes by default) and every read or
write renews it. Items are keyed by the caller's tenant (a digest of it) and the id, so
one caller can never reach another's: another caller's session, an expired one and one
that never existed are the same 404. The tenant is the one API Gateway vouched for (the
router's rule; a ``x-spillway-tenant`` hint counts only with ``trust_tenant_hints``);
a caller without one is refused (401), since anonymous callers would share one scope.

Each tenant holds at most ``quota.count`` sessions and ``quota.bytes`` bytes of stored
JSON (``spillway.state.quotas``: counted with conditional writes on the shared table,
released by a delete or by expiry); past either, a new or larger session is 429
``quota_exceeded`` with ``Retry-After``, and other tenants are unaffected.

The ids are also what ``x-spillway-session`` carries for canary affinity; both are
checked by ``spillway.policy.facts.check_session_id``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from spillway.policy.facts import Call, check_session_id, read_hints
from spillway.protocol.errors import (
    InvalidInputError,
    MethodNotAllowedError,
    NotConfiguredError,
    PayloadTooLargeError,
    SessionNotFoundError,
    UnauthorizedError,
)
from spillway.protocol.framing import JSON_CONTENT_TYPE, load_json_object
from spillway.protocol.replies import Reply, json_bytes
from spillway.state.quotas import QuotaLedger, QuotaLimits
from spillway.state.table import StateStore, scope, ttl_value

PREFIX = "/v1/sessions/"
MAX_SESSION_BYTES = 64 * 1024
QUOTA_COUNT = 256
QUOTA_BYTES = 4 * 1024 * 1024
EXPIRES_HEADER = "x-spillway-session-expires-at"
TENANT_HEADER = "x-spillway-tenant"
_METHODS = "GET, PUT, DELETE"

BodyReader = Callable[[int], bytes]


class Sessions:
    """The session state API over the shared state table (``None``: not configured)."""

    def __init__(
        self,
        store: StateStore | None,
        *,
        ttl_s: float,
        wall: Callable[[], float],
        trust_tenant_hints: bool = False,
        quota_count: int = QUOTA_COUNT,
        quota_bytes: int = QUOTA_BYTES,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.wall = wall
        self.trust_tenant_hints = trust_tenant_hints
        limits = QuotaLimits(quota_count, quota_bytes)
        self.quota = (
            QuotaLedger(store, "sessions", limits, "sessions") if store is not None else None
        )

    def handle(self, path: str, call: Call, read_body: BodyReader) -> Reply:
        """Answer one ``/v1/sessions/{id}`` request; errors are raised for the transport."""
        if self.store is None:
            raise NotConfiguredError(
                "session state is not configured on this router (ROUTER_STATE_TABLE)"
            )
        if call.method not in ("GET", "PUT", "DELETE"):
            raise MethodNotAllowedError(
                f"{call.method[:16]} is not allowed on {path[:200]}", allow=_METHODS
            )
        session = check_session_id(path.removeprefix(PREFIX))
        tenant = scope(self._tenant(call))
        key = _key(tenant, session)
        now = self.wall()
        if call.method == "PUT":
            document = _session_document(_read(read_body))
            expires = now + self.ttl_s
            self._charge(tenant, session, len(json_bytes(document)), now, expires)
            self.store.put(key, document, expires)
            return Reply(204, [(EXPIRES_HEADER, str(ttl_value(expires)))], b"")
        if call.method == "DELETE":
            if not self.store.delete(key, now):
                raise SessionNotFoundError("no such session")
            if self.quota is not None:
                self.quota.release(tenant, session, now)
            return Reply(204, [], b"")
        item = self.store.touch(key, now, now + self.ttl_s)
        if item is None:
            raise SessionNotFoundError("no such session")
        body = json_bytes(item.doc)
        expires_at = str(ttl_value(now + self.ttl_s))
        headers = [("content-type", JSON_CONTENT_TYPE), (EXPIRES_HEADER, expires_at)]
        return Reply(200, headers, body)

    def _tenant(self, call: Call) -> str:
        tenant = call.trusted_tenant
        hint = call.headers.get(TENANT_HEADER)
        if tenant is None and self.trust_tenant_hints and hint is not None:
            tenant = read_hints(None, {TENANT_HEADER: hint}).tenant
        if tenant is None:
            raise UnauthorizedError("session state needs an authenticated caller")
        return tenant

    def _charge(self, tenant: str, session: str, size: int, now: float, expires: float) -> None:
        """Count the session against its tenant's quota before it is written."""
        store, quota = self.store, self.quota
        if store is None or quota is None:
            return

        def probe(name: str, at: float) -> float | None:
            item = store.get(_key(tenant, name), at)
            return None if item is None else (item.expires_at or at + self.ttl_s)

        quota.charge(tenant, session, size, now, expires, probe)


def _key(tenant_scope: str, session: str) -> str:
    return f"session#{tenant_scope}#{session}"


def _read(read_body: BodyReader) -> bytes:
    try:
        return read_body(MAX_SESSION_BYTES)
    except PayloadTooLargeError:
        raise PayloadTooLargeError(
            f"session state is limited to {MAX_SESSION_BYTES} bytes of JSON"
        ) from None


def _session_document(raw: bytes) -> dict[str, object]:
    """The stored object: JSON, an object, without NaN or Infinity (others could not
    read it back as JSON)."""
    if not raw.lstrip().startswith(b"{"):
        raise InvalidInputError("session state must be a JSON object")
    document = load_json_object(raw)
    try:
        json.dumps(document, allow_nan=False)
    except ValueError:
        raise InvalidInputError("session state may not hold NaN or Infinity") from None
    return document
