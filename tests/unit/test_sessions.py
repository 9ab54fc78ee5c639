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
    assert store.items == {}


def test_state_expires_after_its_ttl_and_each_use_renews_it(
    world: tuple[MemoryStateStore, Clock, Any],
) -> None:
    # GIVEN a session stored now
    store, clock, router = world
    alice = Caller(router, "alice")
    alice.put("chat-1", b'{"n": 1}')
    (key,) = store.items
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
    assert len(store.items) == 2
    assert not any("alice" in key or "mallory" in key for key in store.items)
    assert all(item.expires_at is not None for item in store.items.values())


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

    from functions.router.settings import RouterSettings
    from functions.router.wiring import create_app

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
