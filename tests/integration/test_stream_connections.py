"""The WebSocket connection store on DynamoDB (a moto server on 127.0.0.1): atomic counters,
the TTL attribute, seq reservations, one lease holder among 8 threads, closing deletes held
answers; and the gateway on that store routing digits frames through the real router to
a real GPU service."""

from __future__ import annotations

import collections
import json
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillway.protocol.errors import StateUnavailableError
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway.state.table import DynamoStateStore, create_table
from spillway.streams.connections import Admission, held_key
from spillway.streams.dynamo_connections import DynamoConnections
from spillway.streams.gateway import StreamGateway
from spillway.streams.settings import StreamSettings
from spillway.tenancy.identity import Authenticator
from tests.support import Service, load_engine
from tests.unit.stream_support import ENDPOINT, MemoryPoster, ws_event

NOW = 1_800_000_000.0


def _client() -> Any:
    import boto3

    return boto3.client("dynamodb")


@pytest.fixture
def table(aws_env: str) -> Iterator[str]:
    name = f"state-{uuid.uuid4().hex[:8]}"
    create_table(_client(), name)
    yield name
    _client().delete_table(TableName=name)


@pytest.fixture
def store(table: str) -> DynamoConnections:
    return DynamoConnections(DynamoStateStore(table, _client))


def raw_item(table: str, key: str) -> dict[str, Any] | None:
    found: dict[str, Any] | None = (
        _client().get_item(TableName=table, Key={"pk": {"S": key}}, ConsistentRead=True).get("Item")
    )
    return found


def test_open_writes_the_tenant_zero_counters_and_the_ttl_attribute(
    store: DynamoConnections, table: str
) -> None:
    # GIVEN connections of two tenants
    store.open("c-acme=", "acme", NOW + 0.25, 10_800)
    store.open("c-globex=", "globex", NOW, 60)
    # THEN each item has its tenant, its counters at zero and expires_at in whole seconds
    item = raw_item(table, "wsconn#c-acme=")
    assert item is not None
    assert item["expires_at"] == {"N": str(int(NOW) + 10_801)}
    assert item["tenant"] == {"S": "acme"}
    acme = store.get("c-acme=", NOW)
    assert acme is not None
    assert (acme.tenant, acme.next_seq, acme.in_flight, acme.backends) == ("acme", 0, 0, {})
    assert acme.stats()["frames_in"] == 0
    # AND an item past its expiry reads as absent and admits nothing
    assert store.get("c-globex=", NOW + 60) is None
    assert store.admit("c-globex=", 10, 4, NOW + 61) is None
    globex = store.get("c-globex=", NOW)
    assert globex is not None
    assert globex.tenant == "globex"


def test_admission_is_bounded_and_counters_add_up(store: DynamoConnections) -> None:
    # GIVEN a connection and a bound of 2
    store.open("c1", "acme", NOW, 600)
    # WHEN three frames arrive and one is settled
    admissions = [store.admit("c1", 100, 2, NOW, None, f"t{i}") for i in range(3)]
    store.count("c1", {"in_flight": -1, "frames_answered": 1, "cost_usd": 0.25}, "gpu")
    store.count("c1", {"frames_failed": 1, "cost_usd": 0.125}, "cpu")
    store.count("c1", {"frames_answered": 1}, "gpu")
    # THEN two were admitted, the third refused with 2 in flight
    assert [(a.admitted, a.in_flight) for a in admissions if a] == [
        (True, 1),
        (True, 2),
        (False, 2),
    ]
    # AND the counters say so
    connection = store.get("c1", NOW)
    assert connection is not None
    assert connection.stats() | {"connected_at": 0} == {
        "connected_at": 0,
        "tenant": "acme",
        "in_flight": 1,
        "frames_in": 3,
        "frames_answered": 2,
        "frames_failed": 1,
        "frames_refused": 1,
        "bytes_in": 300,
        "bytes_out": 0,
        "cost_usd": 0.375,
        "backends": {"gpu": 2, "cpu": 1},
    }
    # AND counting on a connection that is gone creates nothing
    store.count("gone", {"frames_in": 1})
    assert store.get("gone", NOW) is None


def test_the_frame_held_answers_wait_for_passes_a_full_bound(store: DynamoConnections) -> None:
    # GIVEN a connection with a bound of 3, full: seq 1 and 2 (held for seq 0) and a
    # frame without seq
    store.open("c2", "acme", NOW, 600)
    full = [store.admit("c2", 10, 3, NOW, seq, f"f{seq}") for seq in (1, 2, None)]
    assert [(a.admitted, a.in_flight) for a in full if a] == [(True, 1), (True, 2), (True, 3)]
    # WHEN another frame without seq, then seq 0, arrive
    unordered = store.admit("c2", 10, 3, NOW, None, "u")
    zero = store.admit("c2", 10, 3, NOW, 0, "f0")
    # THEN the first is told to slow down, and seq 0, whose answer frees the held ones,
    # is admitted past the bound, by one (refused, a client that sends it again after
    # the next answer would wait for an answer only it can bring)
    assert unordered is not None
    assert zero is not None
    assert (unordered.admitted, unordered.refusal) == (False, "slow_down")
    assert (zero.admitted, zero.in_flight) == (True, 4)
    # AND a second seq 0 is a duplicate, not admitted
    again = store.admit("c2", 10, 3, NOW, 0, "f0-again")
    assert again is not None
    assert not again.admitted
    assert again.refusal == "duplicate_seq"


class _Churning:
    """A DynamoDB client on a full connection under a burst, as concurrent invocations
    make it: each time a write's condition fails, a frame finishes before the caller hears
    of it; each time the item is read, another frame is admitted just after."""

    def __init__(self, table: str) -> None:
        self.client = _client()
        self.table = table
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def _in_flight(self, delta: str) -> None:
        self.client.update_item(
            TableName=self.table,
            Key={"pk": {"S": "wsconn#c1"}},
            UpdateExpression="ADD in_flight :d",
            ExpressionAttributeValues={":d": {"N": delta}},
        )

    def update_item(self, **kwargs: Any) -> Any:
        from botocore.exceptions import ClientError

        try:
            return self.client.update_item(**kwargs)
        except ClientError:
            self.failed += 1
            self._in_flight("-1")
            raise

    def get_item(self, **kwargs: Any) -> Any:
        found = self.client.get_item(**kwargs)
        self._in_flight("1")
        return found


def test_a_full_connection_refuses_a_frame_while_others_finish_and_arrive(table: str) -> None:
    # GIVEN acme's connection at its bound of 2, and globex's with room
    churning = _Churning(table)
    store = DynamoConnections(DynamoStateStore(table, lambda: churning))
    store.open("c1", "acme", NOW, 600)
    store.open("c2", "globex", NOW, 600)
    assert [store.admit("c1", 10, 2, NOW, None, f"t{i}") for i in range(2)][-1] is not None
    # WHEN a frame arrives while, each time its write is refused, a frame finishes, and
    # another is admitted after each read (a read after the refusal finds room that is gone
    # by the next write)
    admission = store.admit("c1", 10, 2, NOW, None, "late")
    # THEN it is told to slow down, from the item its write was refused on, at once
    assert admission is not None
    assert (admission.refusal, admission.in_flight) == ("slow_down", 2)
    assert churning.failed == 1
    connection = store.get("c1", NOW)
    assert connection is not None
    assert connection.stats()["frames_refused"] == 1
    # AND the other tenant's connection is untouched and admits its frame
    globex = store.admit("c2", 10, 2, NOW, None, "g0")
    assert globex is not None
    assert (globex.refusal, globex.in_flight) == (None, 1)


def test_seq_admission_window_held_answers_and_finish(store: DynamoConnections, table: str) -> None:
    store.open("c1", None, NOW, 600)

    # GIVEN seq 0 and 1 admitted (window 4): the same seq again, one past the window and
    # one already delivered are refused with their reasons; a retried admission is its own
    def admit(seq: int, token: str) -> Admission:
        admission = store.admit("c1", 10, 4, NOW, seq, token)
        assert admission is not None
        return admission

    assert [admit(0, "a").refusal, admit(1, "b").refusal] == [None, None]
    assert admit(0, "a").admitted  # frame a's own write, retried
    assert [admit(1, "c").refusal, admit(4, "d").refusal] == ["duplicate_seq", "seq_out_of_window"]
    # WHEN seq 1's answer is held (counted) and seq 0 is claimed, pushed and finished
    held = store.hold("c1", 1, b'{"id":"b"}', NOW, 900, {"frames_answered": 1}, "cpu")
    assert held is not None
    assert held.pending == {0: "a", 1: "held"}
    assert store.held("c1", 1, NOW) == b'{"id":"b"}'
    assert not store.claim("c1", 1, "me", NOW, NOW + 30)
    assert store.claim("c1", 0, "me", NOW, NOW + 30)
    assert store.finish("c1", 0, "other", NOW, {"bytes_out": 10}) is None
    after = store.finish("c1", 0, "me", NOW, {"bytes_out": 10, "frames_answered": 1}, "gpu")
    # THEN the finish says the next answer is held, with the lease given back
    assert after is not None
    assert (after.next_seq, after.next_is_held(), after.lease_owner) == (1, True, None)
    assert admit(0, "e").refusal == "duplicate_seq"
    # AND finishing a held answer deletes it; a finish retried after its first try went
    # through still reports it, counted once
    assert store.claim("c1", 1, "other", NOW, NOW + 30)
    assert store.finish("c1", 1, "other", NOW, {"bytes_out": 10}) is not None
    assert store.finish("c1", 1, "other", NOW, {"bytes_out": 10}) is not None
    assert raw_item(table, held_key("c1", 1)) is None
    last = store.get("c1", NOW)
    assert last is not None
    assert (last.next_seq, last.in_flight, last.pending) == (2, 0, {})
    assert last.stats() | {"connected_at": 0} == {
        "connected_at": 0,
        "tenant": None,
        "in_flight": 0,
        "frames_in": 5,
        "frames_answered": 2,
        "frames_failed": 0,
        "frames_refused": 3,
        "bytes_in": 50,
        "bytes_out": 20,
        "cost_usd": 0,
        "backends": {"gpu": 1, "cpu": 1},
    }


def test_one_lease_holder_among_eight_threads(store: DynamoConnections) -> None:
    # GIVEN a connection WHEN eight threads take its lease at once
    store.open("c1", "acme", NOW, 600)
    won: list[str] = []
    start = threading.Barrier(8)

    def take(owner: str) -> None:
        start.wait()
        if store.claim("c1", 0, owner, NOW, NOW + 30):
            won.append(owner)

    threads = [threading.Thread(target=take, args=(f"o{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    # THEN exactly one holds it
    assert len(won) == 1
    # AND its holder may claim it again (a retried write); another owner's release leaves
    # it held; it is free once released or expired
    assert store.claim("c1", 0, won[0], NOW + 1, NOW + 31)
    store.release("c1", "intruder")
    assert not store.claim("c1", 0, "late", NOW + 1, NOW + 31)
    assert store.claim("c1", 0, "after-expiry", NOW + 31, NOW + 60)
    store.release("c1", "after-expiry")
    assert store.claim("c1", 0, "next", NOW + 32, NOW + 61)


def test_each_seq_is_claimed_and_advanced_by_one_owner_among_16_racing_threads(
    store: DynamoConnections,
) -> None:
    # GIVEN a connection, and thread switches as frequent as the interpreter allows (moto
    # in this process: a write checked but not yet applied is where a race would land)
    store.open("c1", "acme", NOW, 600)
    advanced: collections.Counter[int] = collections.Counter()
    start = threading.Barrier(16)

    def deliver(owner: str) -> None:
        start.wait()
        for _ in range(15):
            connection = store.get("c1", NOW)
            assert connection is not None
            seq = connection.next_seq
            if store.claim("c1", seq, owner, NOW, NOW + 30) and store.finish(
                "c1", seq, owner, NOW, {"bytes_out": 1}
            ):
                advanced[seq] += 1

    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=deliver, args=(f"o{i}",)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        sys.setswitchinterval(switching)
    # WHEN 16 threads each claim and advance the connection's next seq 15 times
    # THEN every seq was pushed by exactly one of them, and the counters add up
    last = store.get("c1", NOW)
    assert last is not None
    assert set(advanced.values()) == {1}
    assert sorted(advanced) == list(range(last.next_seq))
    assert (last.in_flight, last.counters["bytes_out"]) == (-last.next_seq, last.next_seq)


def test_close_deletes_the_item_and_every_held_answer(store: DynamoConnections, table: str) -> None:
    # GIVEN a connection with next_seq 0 and answers held at 1, 5 and 31 (window 32)
    store.open("c1", "acme", NOW, 600)
    store.admit("c1", 50, 32, NOW, None, "t")
    for seq in (1, 5, 31):
        store.admit("c1", 50, 32, NOW, seq, f"t{seq}")
        store.hold("c1", seq, b"{}", NOW, 900, {})
    # WHEN it closes
    last = store.close("c1", NOW, 32)
    # THEN its last counters come back and nothing of it is left
    assert last is not None
    assert (last.tenant, last.counters["frames_in"], last.in_flight) == ("acme", 4, 4)
    assert raw_item(table, "wsconn#c1") is None
    assert [raw_item(table, held_key("c1", s)) for s in (1, 5, 31)] == [None, None, None]
    assert store.close("c1", NOW, 32) is None


def test_an_unreachable_table_is_state_unavailable(aws_env: str) -> None:
    store = DynamoConnections(DynamoStateStore("no-such-table", _client))
    with pytest.raises(StateUnavailableError) as caught:
        store.get("c1", NOW)
    assert (caught.value.status, caught.value.code) == (503, "unavailable")


def test_digits_frames_through_the_real_router_in_order_per_tenant(
    table: str, service: Service, serving_repo: Path
) -> None:
    # GIVEN the gateway on the moto table, the router built from its settings in front
    # of a real GPU service, and two connections of two tenants
    settings = RouterSettings(
        gpu_url=service.base, state_table=table, metrics_log=Path("/dev/null")
    )
    router = create_app(settings).router
    state = DynamoStateStore(table, _client)
    poster = MemoryPoster()
    gateway = StreamGateway(
        router,
        DynamoConnections(state),
        poster,
        StreamSettings(management_endpoint=ENDPOINT),
        Authenticator(identity_tenants={"key-a": "acme", "key-g": "globex"}),
    )
    for connection, key in (("c-a", "key-a"), ("c-g", "key-g")):
        assert gateway.handle(ws_event("$connect", connection, api_key_id=key))["statusCode"] == 200
    images = np.load(serving_repo / "digits" / "samples" / "images.npy")[:6].astype(np.float32)
    expected = load_engine(serving_repo, "digits").infer({"image": images})["label"]

    def send(connection: str, seq: int) -> None:
        image = images[seq : seq + 1]
        frame = {
            "id": f"{connection}-{seq}",
            "model": "digits",
            "seq": seq,
            "inputs": [
                {
                    "name": "image",
                    "shape": list(image.shape),
                    "datatype": "FP32",
                    "data": image.ravel().tolist(),
                }
            ],
        }
        gateway.handle(ws_event("$default", connection, json.dumps(frame)), 5000.0)

    # WHEN each sends six image frames from six threads at once
    threads = [threading.Thread(target=send, args=(c, s)) for c in ("c-a", "c-g") for s in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    # THEN each connection got its six answers once, in seq order, equal to the engine's
    for connection in ("c-a", "c-g"):
        answers = poster.answers(connection)
        assert [a["seq"] for a in answers] == list(range(6)), answers
        labels = [next(o for o in a["outputs"] if o["name"] == "label")["data"][0] for a in answers]
        assert labels == [int(v) for v in np.asarray(expected).reshape(-1)]
        assert {a["spillway"]["backend"] for a in answers} == {"gpu"}
    # AND stats and $disconnect report each connection's own accounting
    gateway.handle(ws_event("$default", "c-a", json.dumps({"id": "s", "action": "stats"})))
    stats = poster.answers("c-a")[-1]["connection"]
    # (the stats frame itself is in flight while it is answered)
    assert (stats["frames_in"], stats["frames_answered"], stats["in_flight"]) == (7, 6, 1)
    assert stats["backends"] == {"gpu": 6}
    gateway.handle(ws_event("$disconnect", "c-a"))
    assert raw_item(table, "wsconn#c-a") is None
    assert raw_item(table, "wsconn#c-g") is not None
