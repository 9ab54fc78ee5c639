"""Session state on the router: ``PUT/GET/DELETE /v1/sessions/{id}`` over an in-memory
state table and a fake clock: the TTL, renewal on use, callers kept apart, validation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.memory_store import MemoryStateStore
from tests.unit.canary_support import Clock, VersionedBackend, make_router

TTL_S = 900.0


class Caller:
    """Session requests as one tenant, vouched for by an API Gateway authorizer."""

    def __init__(self, router: Any, tenant: str | None) -> None:
        self.client = router.client
        self.environ = {"serverless.authorizer": {"tenant": tenant}} if tenant else {}

    def put(self, session: str, body: bytes | str, **kw: Any) -> Any:
        return self.client.put(
            f"/v1/sessions/{session}", data=body, environ_overrides=self.environ, **kw
        )

    def get(self, session: str) -> Any:
        return self.client.get(f"/v1/sessions/{session}", environ_overrides=self.environ)

    def delete(self, session: str) -> Any:
        return self.client.delete(f"/v1/sessions/{session}", environ_overrides=self.environ)


@pytest.fixture
def world() -> tuple[MemoryStateStore, Clock, Any]:
    store, clock = MemoryStateStore(), Clock()
    return store, clock, make_router(store, clock, VersionedBackend(clock))


def test_put_get_delete(world: tuple[MemoryStateStore, Clock, Any]) -> None:
    store, clock, router = world
    alice = Caller(router, "alice")
    context = {"turns": [{"role": "user", "text": "hello"}], "locale": "en-GB"}
    put = alice.put("chat-1", json.dumps(context), content_type="application/json")
    assert put.status_code == 204
    assert int(put.headers["x-spillway-session-expires-at"]) == clock.now + TTL_S
    got = alice.get("chat-1")
    assert got.status_code == 200
    assert got.json == context
    assert alice.delete("chat-1").status_code == 204
    assert alice.get("chat-1").status_code == 404
    assert alice.delete("chat-1").status_code == 404
    # Only the tenant's quota ledger is left, holding nothing
    (ledger,) = store.items
    assert ledger.startswith("quota#sessions#")
    assert store.items[ledger].doc == {"entries": {}}


def test_state_expires_after_its_ttl_and_each_use_renews_it(
    world: tuple[MemoryStateStore, Clock, Any],
) -> None:
    # GIVEN a session stored now
    store, clock, router = world
    alice = Caller(router, "alice")
    alice.put("chat-1", b'{"n": 1}')
    (key,) = [k for k in store.items if k.startswith("session#")]
    assert store.items[key].expires_at == clock.now + TTL_S  # the TTL attribute, epoch s
    # WHEN it is read 14 minutes later, and again 14 minutes after that
    clock.advance(14 * 60)
    assert alice.get("chat-1").status_code == 200
    assert store.items[key].expires_at == clock.now + TTL_S
    clock.advance(14 * 60)
    # THEN it is still there (each read renewed it) ...
    assert alice.get("chat-1").json == {"n": 1}
    # ... until 15 minutes pass without a use, even before the table deletes the item
    clock.advance(TTL_S)
    assert key in store.items
    answer = alice.get("chat-1")
    assert answer.status_code == 404
    assert json.loads(answer.data)["code"] == "session_not_found"
    # AND a write after expiry starts a new session
    assert alice.put("chat-1", b'{"n": 2}').status_code == 204
    assert alice.get("chat-1").json == {"n": 2}


def test_one_caller_never_reaches_another_callers_session(
    world: tuple[MemoryStateStore, Clock, Any],
) -> None:
    store, _, router = world
    alice, mallory = Caller(router, "alice"), Caller(router, "mallory")
    alice.put("chat-1", b'{"secret": "mine"}')
    # Another caller's session is the same 404 as one that never existed
    assert mallory.get("chat-1").status_code == 404
    assert mallory.get("chat-1").json == mallory.get("chat-9").json
    assert mallory.delete("chat-1").status_code == 404
    # Writing the same id as another caller makes a session of its own
    assert mallory.put("chat-1", b'{"secret": "theirs"}').status_code == 204
    assert alice.get("chat-1").json == {"secret": "mine"}
    assert mallory.get("chat-1").json == {"secret": "theirs"}
    sessions = {k: v for k, v in store.items.items() if k.startswith("session#")}
    assert len(sessions) == 2
    assert not any("alice" in key or "mallory" in key for key in store.items)
    assert all(item.expires_at is not None for item in sessions.values())


def test_a_caller_without_an_identity_is_refused(
    world: tuple[MemoryStateStore, Clock, Any],
) -> None:
    _, _, router = world
    anonymous = Caller(router, None)
    answer = anonymous.put("chat-1", b"{}")
    assert answer.status_code == 401
    assert json.loads(answer.data)["code"] == "unauthorized"
    # A tenant header counts only where the router trusts hints
    hinted = router.client.get("/v1/sessions/chat-1", headers={"x-spillway-tenant": "alice"})
    assert hinted.status_code == 401


def test_a_tenant_hint_counts_when_hints_are_trusted() -> None:
    store, clock = MemoryStateStore(), Clock()
    router = make_router(store, clock, VersionedBackend(clock), trust_tenant_hints=True)
    headers = {"x-spillway-tenant": "alice"}
    assert router.client.put("/v1/sessions/s", data=b"{}", headers=headers).status_code == 204
    assert router.client.get("/v1/sessions/s", headers=headers).json == {}
    assert (
        router.client.get("/v1/sessions/s", headers={"x-spillway-tenant": "bob"}).status_code == 404
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "text"),
    [
        ("/v1/sessions/a%2Fb", b"{}", 400, "session id"),
        ("/v1/sessions/a/b", b"{}", 400, "session id"),
        ("/v1/sessions/" + "x" * 129, b"{}", 400, "session id"),
        ("/v1/sessions/.hidden", b"{}", 400, "session id"),
        ("/v1/sessions/", b"{}", 400, "session id"),
        ("/v1/sessions/ok", b"[1, 2]", 400, "JSON object"),
        ("/v1/sessions/ok", b'"text"', 400, "JSON object"),
        ("/v1/sessions/ok", b"", 400, "JSON object"),
        ("/v1/sessions/ok", b"{not json", 400, "invalid JSON"),
        ("/v1/sessions/ok", b'{"x": NaN}', 400, "NaN"),
        ("/v1/sessions/ok", b'{"a": [' + b"[" * 5000 + b"]" * 5000 + b"]}", 400, "nested"),
        ("/v1/sessions/ok", b"{\xff}", 400, "invalid JSON"),
        ("/v1/sessions/ok", b'{"pad": "' + b"x" * (64 * 1024) + b'"}', 413, "65536 bytes"),
    ],
)
def test_bad_requests_are_clear_4xx(
    world: tuple[MemoryStateStore, Clock, Any], path: str, body: bytes, status: int, text: str
) -> None:
    store, _, router = world
    answer = router.client.put(
        path, data=body, environ_overrides={"serverless.authorizer": {"tenant": "alice"}}
    )
    assert answer.status_code == status, answer.data
    assert text in json.loads(answer.data)["error"]
    assert store.items == {}


def test_64_kib_of_json_is_accepted(world: tuple[MemoryStateStore, Clock, Any]) -> None:
    _, _, router = world
    alice = Caller(router, "alice")
    body = b'{"pad": "' + b"x" * (64 * 1024 - 11) + b'"}'
    assert len(body) == 64 * 1024
    assert alice.put("big", body).status_code == 204
    assert len(json.loads(alice.get("big").data)["pad"]) == 64 * 1024 - 11


def test_other_methods_are_405_with_allow(world: tuple[MemoryStateStore, Clock, Any]) -> None:
    _, _, router = world
    answer = router.client.post("/v1/sessions/s", data=b"{}")
    assert answer.status_code == 405
    assert answer.headers["allow"] == "GET, PUT, DELETE"


def test_without_a_state_table_there_are_no_sessions() -> None:
    from werkzeug.test import Client

    from spillway.router.settings import RouterSettings
    from spillway.router.wiring import create_app

    client = Client(create_app(RouterSettings(metrics_log="/dev/null")))
    answer = client.get("/v1/sessions/s")
    assert answer.status_code == 400
    assert json.loads(answer.data)["code"] == "not_configured"
    assert "not configured" in json.loads(answer.data)["error"]


def test_an_unreachable_table_is_503_with_retry_after(
    world: tuple[MemoryStateStore, Clock, Any],
) -> None:
    store, _, router = world
    store.down = True
    answer = Caller(router, "alice").get("s")
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"


# --- quotas per tenant -------------------------------------------------------------------

KIB = 1024


def padded(size: int) -> bytes:
    """A JSON object of exactly ``size`` bytes."""
    body = b'{"pad": "' + b"x" * (size - 11) + b'"}'
    assert len(body) == size
    return body


def test_one_tenant_creating_400_sessions_of_64_kib_meets_its_quota_and_another_does_not(
    world: tuple[MemoryStateStore, Clock, Any],
) -> None:
    # GIVEN a router with the default session quotas and two tenants
    store, _, router = world
    greedy, other = Caller(router, "greedy"), Caller(router, "other")
    # WHEN one tenant creates 400 sessions of 64 KiB each
    answers = [greedy.put(f"s-{i}", padded(64 * KIB)) for i in range(400)]
    # THEN it holds no more than its byte quota (4 MiB: 64 of them); the rest are 429
    statuses = [a.status_code for a in answers]
    assert statuses.count(204) == 64
    assert statuses[64:] == [429] * 336
    refused = answers[64]
    assert json.loads(refused.data)["code"] == "quota_exceeded"
    assert "4194304 bytes" in json.loads(refused.data)["error"]
    assert 1 <= int(refused.headers["retry-after"]) <= TTL_S
    held = [k for k in store.items if k.startswith("session#")]
    assert len(held) == 64
    # AND the other tenant still creates its sessions
    assert [other.put(f"s-{i}", padded(64 * KIB)).status_code for i in range(3)] == [204] * 3
    assert other.get("s-2").status_code == 200


def test_the_count_quota_refuses_the_next_session_and_a_delete_makes_room() -> None:
    # GIVEN a router allowing 5 sessions per tenant
    store, clock = MemoryStateStore(), Clock()
    router = make_router(store, clock, VersionedBackend(clock), session_quota_count=5)
    alice, bob = Caller(router, "alice"), Caller(router, "bob")
    assert [alice.put(f"s-{i}", b"{}").status_code for i in range(5)] == [204] * 5
    # WHEN a sixth is created
    sixth = alice.put("s-5", b"{}")
    # THEN it is refused with the stable code, naming the count quota
    assert sixth.status_code == 429
    assert json.loads(sixth.data) == {
        "error": "this tenant holds 5 sessions, its quota; delete one or let one expire",
        "code": "quota_exceeded",
    }
    # AND rewriting a session it holds is not a new one
    assert alice.put("s-3", b'{"turn": 2}').status_code == 204
    # AND bob is not affected
    assert bob.put("s-0", b"{}").status_code == 204
    # WHEN alice deletes one, the next is accepted
    assert alice.delete("s-0").status_code == 204
    assert alice.put("s-5", b"{}").status_code == 204
    assert alice.put("s-6", b"{}").status_code == 429


def test_an_expired_session_releases_its_quota_and_a_renewed_one_does_not() -> None:
    # GIVEN a tenant at its quota of 3 sessions, created at t=0, t=100 and t=200
    store, clock = MemoryStateStore(), Clock()
    router = make_router(store, clock, VersionedBackend(clock), session_quota_count=3)
    alice = Caller(router, "alice")
    for i in range(3):
        assert alice.put(f"s-{i}", b"{}").status_code == 204
        clock.advance(100)
    # WHEN s-0 is read (renewed) at t=300 and s-1 is left alone until both would expire
    assert alice.get("s-0").status_code == 200
    clock.advance(TTL_S - 150)  # t=1050: s-1 (t=100) expired, s-0 renewed until t=1200
    # THEN one new session fits (s-1's room), and a second does not (s-0 is still held)
    assert alice.put("s-new", b"{}").status_code == 204
    refused = alice.put("s-newer", b"{}")
    assert refused.status_code == 429
    assert alice.get("s-0").status_code == 200


def test_the_bytes_quota_counts_what_a_rewrite_holds() -> None:
    store, clock = MemoryStateStore(), Clock()
    router = make_router(store, clock, VersionedBackend(clock), session_quota_bytes=100 * KIB)
    alice = Caller(router, "alice")
    assert alice.put("a", padded(60 * KIB)).status_code == 204
    assert alice.put("b", padded(40 * KIB)).status_code == 204
    assert alice.put("c", padded(1 * KIB)).status_code == 429
    # Shrinking a session makes room; growing it back past the quota is refused
    assert alice.put("a", padded(10 * KIB)).status_code == 204
    assert alice.put("c", padded(50 * KIB)).status_code == 204
    assert alice.put("a", padded(20 * KIB)).status_code == 429
    assert alice.get("a").status_code == 200
    assert len(json.loads(alice.get("a").data)["pad"]) == 10 * KIB - 11


def test_concurrent_writers_of_one_tenant_never_pass_its_quota() -> None:
    # GIVEN a quota of 20 sessions and 8 threads creating 10 sessions each at once
    from concurrent.futures import ThreadPoolExecutor

    from spillway.policy.facts import Call
    from spillway.protocol.errors import SpillwayError
    from spillway.router.sessions import Sessions

    store, clock = MemoryStateStore(), Clock()
    sessions = Sessions(store, ttl_s=TTL_S, wall=clock, quota_count=20, quota_bytes=10**9)

    def create(n: int) -> int:
        call = Call("PUT", {}, b"{}", f"r-{n}", trusted_tenant="alice")
        try:
            return sessions.handle(f"/v1/sessions/s-{n}", call, lambda _: b"{}").status
        except SpillwayError as exc:
            return exc.status

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(create, range(80)))
    # THEN exactly 20 were accepted and the others refused
    assert statuses.count(204) == 20
    assert statuses.count(429) == 60
    assert len([k for k in store.items if k.startswith("session#")]) == 20
