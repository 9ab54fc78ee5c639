"""The WebSocket gateway: one answer per frame, seq frames pushed in seq order whatever
order they finish in, back-pressure, duplicate and out-of-window seqs, tenancy from the
connection only, gone connections cleaned up, router errors with their codes."""

from __future__ import annotations

import base64
import io
import json
import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from spillway.policy.backend import BackendRequest, BackendResponse
from spillway.policy.facts import Call
from spillway.protocol.errors import InvalidInputError, StateUnavailableError
from spillway.protocol.framing import HEADER_LENGTH
from spillway.protocol.replies import Reply, json_reply
from spillway.protocol.wire import Target
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway.streams.connections import Admission, Connection
from spillway.streams.delivery import ApiGatewayPoster
from spillway.streams.gateway import StreamGateway
from spillway.streams.settings import StreamSettings
from spillway.tenancy.identity import Authenticator
from tests.unit.router_support import fake_overrides
from tests.unit.stream_support import (
    ENDPOINT,
    MemoryConnections,
    MemoryPoster,
    text,
    ws_event,
)

TENANTS = {"key-acme": "acme", "key-globex": "globex"}
INPUTS = [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]


@dataclass
class FakeRouter:
    """Answers by model: ``echo`` 200 (the call's tenant in the outputs), ``boom`` raises
    RuntimeError, ``bad`` raises InvalidInputError, ``missing`` 404s. A frame whose id is
    in ``gates`` waits until its gate is opened."""

    calls: list[Call] = field(default_factory=list)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def route(self, call: Call, target: Target) -> Reply:
        length = call.headers.get(HEADER_LENGTH)
        request = json.loads(call.body[: int(length)] if length else call.body)
        with self.lock:
            self.calls.append(call)
        gate = self.gates.get(request["id"])
        if gate is not None:
            assert gate.wait(30)
        if target.model == "boom":
            raise RuntimeError("a bug")
        if target.model == "bad":
            raise InvalidInputError("input 'x' has the wrong shape")
        if target.model == "missing":
            return json_reply(404, {"error": "unknown model 'missing'", "code": "model_not_found"})
        body = {
            "model_name": target.model,
            "outputs": [{"name": "tenant", "data": [call.trusted_tenant]}],
        }
        headers = [
            ("x-spillway-backend", "gpu"),
            ("x-spillway-rule", "default"),
            ("x-spillway-cost-usd", "0.5"),
        ]
        return json_reply(200, body, headers)


@dataclass
class Harness:
    gateway: StreamGateway
    router: FakeRouter
    store: MemoryConnections
    poster: MemoryPoster
    closed: list[Connection]

    def connect(self, connection_id: str, api_key_id: str | None = "key-acme") -> dict[str, Any]:
        return self.gateway.handle(ws_event("$connect", connection_id, api_key_id=api_key_id))

    def send(self, connection_id: str, body: str, binary: bool = False) -> dict[str, Any]:
        return self.gateway.handle(ws_event("$default", connection_id, body, binary=binary), 5000.0)

    def frame(self, connection_id: str, **fields: Any) -> dict[str, Any]:
        return self.send(connection_id, text(**fields))

    def answers(self, connection_id: str) -> list[dict[str, Any]]:
        return self.poster.answers(connection_id)


def harness(router: Any = None, store: MemoryConnections | None = None, **settings: Any) -> Harness:
    store, poster = store or MemoryConnections(), MemoryPoster()
    closed: list[Connection] = []
    gateway = StreamGateway(
        router or FakeRouter(),
        store,
        poster,
        StreamSettings(management_endpoint=ENDPOINT, **settings),
        Authenticator(identity_tenants=TENANTS),
        clock=lambda: 1_000_000.0,
        on_close=closed.append,
    )
    return Harness(gateway, gateway.router, store, poster, closed)  # type: ignore[arg-type]


@pytest.fixture
def h() -> Harness:
    return harness()


def in_threads(*calls: Callable[[], Any]) -> list[threading.Thread]:
    threads = [threading.Thread(target=call) for call in calls]
    for thread in threads:
        thread.start()
    return threads


def wait_until(condition: Callable[[], bool]) -> None:
    event = threading.Event()
    for _ in range(3000):
        if condition():
            return
        event.wait(0.01)
    raise AssertionError("condition not met")


# --- connecting -------------------------------------------------------------------------


def test_connect_stores_the_tenant_and_an_unauthenticated_caller_is_refused(h: Harness) -> None:
    # GIVEN a caller with an API key and one with nothing that vouches for it
    # WHEN both connect
    assert h.connect("c-acme") == {"statusCode": 200}
    refused = h.connect("c-anon", api_key_id=None)
    # THEN the first has its connection item with its tenant, the second is 401
    assert h.store.items["c-acme"].tenant == "acme"
    assert h.store.items["c-acme"].expires_at == 1_000_000.0 + 10_800
    assert refused["statusCode"] == 401
    assert json.loads(refused["body"])["code"] == "unauthenticated"
    assert "c-anon" not in h.store.items


def test_a_frame_on_an_unknown_connection_is_not_connected(h: Harness) -> None:
    h.frame("c-x", id="f1", model="echo", inputs=INPUTS)
    h.send("c-x", "not json")
    assert h.answers("c-x") == [
        {"id": "f1", "error": "not connected", "code": "not_connected", "status": 401},
        {
            "id": None,
            "error": "invalid JSON: Expecting value at position 0",
            "code": "invalid_frame",
            "status": 400,
        },
    ]
    assert h.router.calls == []
    assert h.store.items == {}


class UnreachableAdmit(MemoryConnections):
    def admit(
        self,
        connection_id: str,
        size: int,
        limit: int,
        now: float,
        seq: int | None = None,
        token: str = "",
    ) -> Admission | None:
        raise StateUnavailableError("the state table t cannot be reached (EndpointConnectionError)")


def test_a_frame_the_state_table_cannot_admit_is_answered_unavailable() -> None:
    h = harness()
    h.gateway.store = h.store = UnreachableAdmit()
    h.connect("c1")
    h.frame("c1", id="f1", seq=0, model="echo", inputs=INPUTS)
    (answer,) = h.answers("c1")
    assert (answer["id"], answer["seq"], answer["code"], answer["status"]) == (
        "f1",
        0,
        "unavailable",
        503,
    )
    assert h.router.calls == []


def test_without_a_state_table_connect_is_refused_with_503() -> None:
    gateway = StreamGateway(
        FakeRouter(),
        None,
        MemoryPoster(),
        StreamSettings(),
        Authenticator(identity_tenants=TENANTS),
    )
    answer = gateway.handle(ws_event("$connect", "c1", api_key_id="key-acme"))
    assert answer["statusCode"] == 503
    assert json.loads(answer["body"])["code"] == "websocket_not_configured"


# --- answers -----------------------------------------------------------------------------


def test_an_unordered_frame_is_answered_once_with_its_id_and_accounted(h: Harness) -> None:
    # GIVEN a connection of tenant acme
    h.connect("c1")
    # WHEN it sends two frames without seq, the second with a base64 BYTES input
    h.frame("c1", id="f1", model="echo", inputs=INPUTS)
    image = {
        "name": "image",
        "shape": [1],
        "datatype": "BYTES",
        "parameters": {"content_type": "base64"},
        "data": ["iVBORw0KGgo="],
    }
    h.frame("c1", id="f2", model="echo", inputs=[image])
    # THEN each gets exactly one answer: the response with its id and what the router did
    first, second = h.answers("c1")
    assert first == {
        "model_name": "echo",
        "outputs": [{"name": "tenant", "data": ["acme"]}],
        "id": "f1",
        "spillway": {"backend": "gpu", "rule": "default", "cost_usd": 0.5, "fallback": None},
    }
    assert second["id"] == "f2"
    # (the router gets the input as sent: the server that decodes the request reads it)
    assert json.loads(h.router.calls[1].body)["inputs"] == [image]
    # AND the connection's counters say so
    stats = h.store.get("c1", 0)
    assert stats is not None
    assert stats.stats() | {"connected_at": 0} == {
        "connected_at": 0,
        "tenant": "acme",
        "in_flight": 0,
        "frames_in": 2,
        "frames_answered": 2,
        "frames_failed": 0,
        "frames_refused": 0,
        "bytes_in": stats.counters["bytes_in"],
        "bytes_out": stats.counters["bytes_out"],
        "cost_usd": 1.0,
        "backends": {"gpu": 2},
    }
    assert stats.counters["bytes_out"] == sum(
        len(json.dumps(a, separators=(",", ":"))) for a in (first, second)
    )


def test_router_errors_keep_their_code_and_an_unexpected_one_is_internal(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    h.connect("c1")
    # WHEN frames meet a 404 reply, a SpillwayError and a bug
    with caplog.at_level(logging.INFO, logger="spillway.streams"):
        h.frame("c1", id="a", model="missing", inputs=INPUTS)
        h.frame("c1", id="b", model="bad", inputs=INPUTS)
        h.frame("c1", id="c", model="boom", inputs=INPUTS)
        h.frame("c1", id="d", model="Not-A-Name", inputs=INPUTS)
    # THEN each is one failure answer with the code and status of its cause
    assert [(a["id"], a["code"], a["status"]) for a in h.answers("c1")] == [
        ("a", "model_not_found", 404),
        ("b", "invalid_input", 400),
        ("c", "internal", 500),
        ("d", "invalid_model_name", 400),
    ]
    assert h.answers("c1")[2]["error"] == "internal error"
    # AND the bug is logged with its traceback, the client sees no detail
    (bug,) = [r for r in caplog.records if r.message == "unhandled error"]
    assert bug.exc_info is not None
    assert "a bug" not in json.dumps(h.answers("c1"))
    stats = h.store.get("c1", 0)
    assert stats is not None
    assert (stats.counters["frames_failed"], stats.in_flight) == (4, 0)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("not json", "invalid_frame"),
        ('{"id": "f", "seq": -1}', "invalid_frame"),
        ('{"id": "f", "seq": true}', "invalid_frame"),
        ("[]", "invalid_frame"),
        ("x" * 2000, "message_too_large"),
    ],
)
def test_a_hostile_frame_is_refused_once_and_counted(body: str, code: str) -> None:
    h = harness(max_message_bytes=1024)
    h.connect("c1")
    h.send("c1", body)
    (answer,) = h.answers("c1")
    assert answer["code"] == code
    assert "seq" not in answer
    stats = h.store.get("c1", 0)
    assert stats is not None
    assert (stats.counters["frames_in"], stats.counters["frames_refused"], stats.in_flight) == (
        1,
        1,
        0,
    )
    assert h.router.calls == []


def test_an_event_marked_base64_is_refused_as_invalid_frame_without_decoding_it(
    h: Harness,
) -> None:
    # GIVEN a connection WHEN a $default event marked isBase64Encoded arrives (a binary
    # frame: API Gateway closes the connection on one and never hands it over), its body
    # the base64 of a valid text frame
    h.connect("c1")
    frame = text(id="f1", seq=0, model="echo", inputs=INPUTS)
    h.send("c1", base64.b64encode(frame.encode()).decode(), binary=True)
    # THEN it is refused at once with invalid_frame, never routed, counted as refused
    (answer,) = h.answers("c1")
    assert (answer["id"], answer["code"], answer["status"]) == (None, "invalid_frame", 400)
    assert "content_type" in answer["error"]
    assert h.router.calls == []
    stats = h.store.get("c1", 0)
    assert stats is not None
    assert (stats.counters["frames_refused"], stats.next_seq, stats.in_flight) == (1, 0, 0)


def test_a_too_large_answer_is_replaced_by_its_413() -> None:
    h = harness(max_message_bytes=1024)
    h.connect("c1")
    h.frame("c1", id="big", seq=0, model="echo", inputs=INPUTS, pad="p" * 10)
    h.router.route = lambda call, target: json_reply(200, {"outputs": ["y" * 2000]})  # type: ignore[method-assign]
    h.frame("c1", id="big2", seq=1, model="echo", inputs=INPUTS)
    answers = h.answers("c1")
    assert [a["id"] for a in answers] == ["big", "big2"]
    assert (answers[1]["code"], answers[1]["status"], answers[1]["seq"]) == (
        "message_too_large",
        413,
        1,
    )


# --- tenancy ------------------------------------------------------------------------------


def test_the_tenant_is_the_connection_s_never_the_frame_s(h: Harness) -> None:
    # GIVEN connections of two tenants
    h.connect("c-acme", "key-acme")
    h.connect("c-globex", "key-globex")
    # WHEN acme's frame claims globex in its parameters and in a header-like field
    h.frame(
        "c-acme",
        id="f",
        model="echo",
        inputs=INPUTS,
        parameters={"tenant": "globex"},
        **{"x-spillway-tenant": "globex"},
    )
    h.frame("c-globex", id="g", model="echo", inputs=INPUTS)
    # THEN each call carries its own connection's tenant
    assert [c.trusted_tenant for c in h.router.calls] == ["acme", "globex"]
    assert h.answers("c-acme")[0]["outputs"][0]["data"] == ["acme"]
    # AND stats answer each connection's own accounting only
    h.frame("c-acme", id="s", action="stats")
    h.frame("c-globex", id="s", action="stats")
    h.frame("c-globex", id="s2", action="stats")
    acme = h.answers("c-acme")[-1]
    globex = h.answers("c-globex")[-1]
    assert acme["id"] == "s"
    assert (acme["connection"]["frames_in"], acme["connection"]["frames_answered"]) == (2, 1)
    assert (globex["connection"]["frames_in"], globex["connection"]["frames_answered"]) == (3, 2)
    assert acme["connection"]["cost_usd"] == 0.5
    assert len(h.router.calls) == 2  # stats never reach the router


# --- order ---------------------------------------------------------------------------------


def test_seq_frames_finishing_in_a_scrambled_order_are_pushed_in_seq_order(h: Harness) -> None:
    # GIVEN eight seq frames on one connection, each held in the router until released
    h.connect("c1")
    gates = {f"f{seq}": threading.Event() for seq in range(8)}
    h.router.gates.update(gates)

    def send(seq: int) -> Callable[[], Any]:
        return lambda: h.frame("c1", id=f"f{seq}", seq=seq, model="echo", inputs=INPUTS)

    threads = {seq: in_threads(send(seq))[0] for seq in range(8)}
    wait_until(lambda: len(h.router.calls) == 8)
    # WHEN they finish one at a time in a scrambled order
    pushed_after = []
    for seq in (5, 2, 7, 0, 3, 1, 6, 4):
        gates[f"f{seq}"].set()
        threads[seq].join(30)
        pushed_after.append([a["seq"] for a in h.answers("c1")])
    # THEN an answer is pushed only when every earlier seq was, and all in seq order
    assert pushed_after == [
        [],
        [],
        [],
        [0],
        [0],
        [0, 1, 2, 3],
        [0, 1, 2, 3],
        [0, 1, 2, 3, 4, 5, 6, 7],
    ]
    assert [a["id"] for a in h.answers("c1")] == [f"f{s}" for s in range(8)]
    # AND nothing is left in flight or held
    stats = h.store.get("c1", 0)
    assert stats is not None
    assert (stats.in_flight, stats.next_seq, h.store.held_items) == (0, 8, {})


def test_many_threads_racing_on_two_connections_get_each_answer_once_in_order() -> None:
    # GIVEN two connections of two tenants, 64 seq frames and 16 unordered ones each
    h = harness(max_in_flight=1000)
    h.connect("c-acme", "key-acme")
    h.connect("c-globex", "key-globex")
    jobs = [(c, s) for c in ("c-acme", "c-globex") for s in [*range(64), *[None] * 16]]
    random.Random(5).shuffle(jobs)

    def send(job: tuple[str, int | None]) -> None:
        connection, seq = job
        fields = {} if seq is None else {"seq": seq}
        h.frame(connection, id=f"{connection}-{seq}", model="echo", inputs=INPUTS, **fields)

    # WHEN 16 threads send them all at once
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(send, jobs))
    # THEN each connection got 80 answers: its 64 seq answers exactly once, in order
    for connection, tenant in (("c-acme", "acme"), ("c-globex", "globex")):
        answers = h.answers(connection)
        assert len(answers) == 80
        assert [a["seq"] for a in answers if "seq" in a] == list(range(64))
        assert {a["outputs"][0]["data"][0] for a in answers} == {tenant}
        stats = h.store.get(connection, 0)
        assert stats is not None
        assert (stats.in_flight, stats.counters["frames_answered"]) == (0, 80)


class PausingFinish(MemoryConnections):
    """Its first ``finish`` (which gives the lease back) waits until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.advancing, self.go = threading.Event(), threading.Event()

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
        if not self.advancing.is_set():
            self.advancing.set()
            assert self.go.wait(30)
        return super().finish(connection_id, seq, owner, now, deltas, backend, held=held)


def test_an_answer_held_while_the_lease_is_being_given_back_is_not_stranded() -> None:
    # GIVEN a call that pushed seq 0 and is about to give the delivery lease back
    store = PausingFinish()
    h = harness(store=store)
    h.connect("c1")
    (first,) = in_threads(lambda: h.frame("c1", id="f0", seq=0, model="echo", inputs=INPUTS))
    assert store.advancing.wait(30)
    # WHEN seq 1's answer is held meanwhile and its call finds the lease taken
    h.frame("c1", id="f1", seq=1, model="echo", inputs=INPUTS)
    assert [a["seq"] for a in h.answers("c1")] == [0]
    store.go.set()
    first.join(30)
    # THEN the first call, looking again after giving the lease back, pushes seq 1
    assert [a["seq"] for a in h.answers("c1")] == [0, 1]
    assert store.held_items == {}


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class SlowRead(MemoryConnections):
    """Its first read of a held answer stalls (a state table answering late, its call
    retried) until ``go`` is set, the clock moved past the lease meanwhile."""

    def __init__(self, clock: Clock, lease_s: float) -> None:
        super().__init__()
        self.clock, self.lease_s = clock, lease_s
        self.reading, self.go = threading.Event(), threading.Event()

    def held(self, connection_id: str, seq: int, now: float) -> bytes | None:
        answer = super().held(connection_id, seq, now)
        if answer is not None and not self.reading.is_set():
            self.reading.set()
            assert self.go.wait(30)
            self.clock.now += self.lease_s + 1
        return answer


def test_a_delivery_that_stalls_past_the_lease_does_not_push_an_answer_twice() -> None:
    # GIVEN seq 1's answer held, and seq 0's call, which delivers it next, stalling
    # between reading that answer and pushing it
    clock = Clock()
    store = SlowRead(clock, 5.0)
    h = harness(store=store, lease_s=5.0)
    h.gateway.clock = clock
    h.connect("c1")
    h.frame("c1", id="f1", seq=1, model="echo", inputs=INPUTS)
    (first,) = in_threads(lambda: h.frame("c1", id="f0", seq=0, model="echo", inputs=INPUTS))
    assert store.reading.wait(30)
    # WHEN the lease runs out and seq 2's call delivers seq 1 and 2 meanwhile
    clock.now += 6
    h.frame("c1", id="f2", seq=2, model="echo", inputs=INPUTS)
    store.go.set()
    first.join(30)
    # THEN each answer was pushed exactly once, in order, and nothing is left in flight
    assert [a["id"] for a in h.answers("c1")] == ["f0", "f1", "f2"]
    stats = store.get("c1", clock.now)
    assert stats is not None
    assert (stats.in_flight, stats.next_seq, store.held_items) == (0, 3, {})


def test_an_invocation_near_its_end_hands_held_answers_to_a_frame_still_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # GIVEN acme's seq 0 and 3 in the router, seq 1 and 2 answered and held behind seq 0;
    # globex's seq 0 in the router, its seq 1 held; each invocation has 5 s
    clock = Clock()
    h = harness()
    h.gateway.clock = clock
    h.connect("c1")
    h.connect("c2", "key-globex")
    gates = {name: threading.Event() for name in ("a0", "a3", "g0")}
    h.router.gates.update(gates)

    def sender(connection: str, name: str, seq: int) -> Callable[[], Any]:
        return lambda: h.frame(connection, id=name, seq=seq, model="echo", inputs=INPUTS)

    running = {
        name: in_threads(sender(connection, name, seq))[0]
        for name, connection, seq in (("a0", "c1", 0), ("a3", "c1", 3), ("g0", "c2", 0))
    }
    wait_until(lambda: len(h.router.calls) == 3)
    for seq in (1, 2):
        h.frame("c1", id=f"a{seq}", seq=seq, model="echo", inputs=INPUTS)
    h.frame("c2", id="g1", seq=1, model="echo", inputs=INPUTS)
    assert (h.answers("c1"), h.answers("c2")) == ([], [])
    # WHEN seq 0's answers come with less than handover_reserve_s of their time left
    clock.now += 5 - h.gateway.handover_reserve_s + 0.5
    caplog.set_level(logging.INFO, logger="spillway.streams")
    for name in ("a0", "g0"):
        gates[name].set()
        running[name].join(30)
    # THEN acme's invocation pushed its own answer and left seq 1 and 2 to seq 3's, still
    # served; globex's, with no other frame being served, pushed its held seq 1 itself
    assert [a["seq"] for a in h.answers("c1")] == [0]
    assert [a["seq"] for a in h.answers("c2")] == [0, 1]
    handed = [r for r in caplog.records if r.getMessage() == "held answers handed over"]
    assert [(r.__dict__["connection_id"], r.__dict__["next_seq"]) for r in handed] == [("c1", 1)]
    # AND when seq 3 is answered, its invocation (also near its end, but the last one
    # served) pushes 1, 2 and 3 in order, once each, nothing left held
    gates["a3"].set()
    running["a3"].join(30)
    assert [a["id"] for a in h.answers("c1")] == ["a0", "a1", "a2", "a3"]
    stats = h.store.get("c1", clock.now)
    assert stats is not None
    assert (stats.in_flight, stats.next_seq, h.store.held_items) == (0, 4, {})


class RetriedWrites(MemoryConnections):
    """Every conditional write applied twice, the second answer returned: botocore
    retrying a write whose first try went through but whose answer timed out."""

    def admit(
        self,
        connection_id: str,
        size: int,
        limit: int,
        now: float,
        seq: int | None = None,
        token: str = "",
    ) -> Admission | None:
        super().admit(connection_id, size, limit, now, seq, token)
        return super().admit(connection_id, size, limit, now, seq, token)

    def claim(self, connection_id: str, seq: int, owner: str, now: float, until: float) -> bool:
        super().claim(connection_id, seq, owner, now, until)
        return super().claim(connection_id, seq, owner, now, until)

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
        super().finish(connection_id, seq, owner, now, deltas, backend, held=held)
        return super().finish(connection_id, seq, owner, now, deltas, backend, held=held)


def test_retried_writes_still_deliver_every_answer_once_and_count_it_once() -> None:
    # GIVEN a state table whose conditional writes are each retried after going through
    store = RetriedWrites()
    h = harness(store=store)
    h.connect("c1")
    # WHEN frames arrive out of order
    for seq in (1, 0, 3, 2):
        h.frame("c1", id=f"f{seq}", seq=seq, model="echo", inputs=INPUTS)
    # THEN an admission, a claim or a finish retried by its own caller is not refused:
    # all four pushed once, in order, counted once
    assert [a["seq"] for a in h.answers("c1")] == [0, 1, 2, 3]
    stats = store.get("c1", 0)
    assert stats is not None
    assert (stats.in_flight, stats.next_seq, stats.counters["frames_in"]) == (0, 4, 4)


class Unreachable(MemoryConnections):
    """The state table unreachable for the first call of each settling operation."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: set[str] = set()

    def _once(self, name: str) -> None:
        if name not in self.failed:
            self.failed.add(name)
            raise StateUnavailableError("the state table t cannot be reached (ReadTimeoutError)")

    def claim(self, connection_id: str, seq: int, owner: str, now: float, until: float) -> bool:
        self._once("claim")
        return super().claim(connection_id, seq, owner, now, until)

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
        self._once("hold")
        return super().hold(connection_id, seq, answer, now, ttl_s, deltas, backend)

    def count(
        self, connection_id: str, deltas: Mapping[str, float], backend: str | None = None
    ) -> None:
        if "frames_answered" in deltas:
            self._once("count")
        super().count(connection_id, deltas, backend)


def test_a_state_table_failing_after_admission_is_tried_again_and_no_answer_is_lost() -> None:
    # GIVEN a state table whose first claim, hold and settling count fail
    store = Unreachable()
    h = harness(store=store)
    h.gateway.retry_pauses_s = (0.0, 0.0)
    h.connect("c1")
    # WHEN seq 1, seq 0 and a frame without seq are answered
    for fields in ({"seq": 1}, {"seq": 0}, {}):
        h.frame("c1", id=f"f{fields.get('seq', 'x')}", model="echo", inputs=INPUTS, **fields)
    # THEN each was pushed once, the seq frames in order, and the counters add up
    assert [a["id"] for a in h.answers("c1")] == ["f0", "f1", "fx"]
    assert store.failed == {"claim", "hold", "count"}
    stats = store.get("c1", 0)
    assert stats is not None
    assert (stats.in_flight, stats.next_seq, stats.counters["frames_answered"]) == (0, 2, 3)


class FlakyManagement:
    """``post_to_connection`` failing with the given errors first, then taking posts."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.posts = list(errors), 0

    def post_to_connection(self, ConnectionId: str, Data: bytes) -> None:
        self.posts += 1
        if self.errors:
            raise self.errors.pop(0)


def test_a_post_is_sent_again_only_when_it_surely_did_not_arrive() -> None:
    from botocore.exceptions import (
        ConnectionClosedError,
        EndpointConnectionError,
        ReadTimeoutError,
    )

    # GIVEN a post whose answer timed out: it may have arrived, so it is not sent again
    timed_out = FlakyManagement(ReadTimeoutError(endpoint_url=ENDPOINT))
    ApiGatewayPoster(lambda _: timed_out).post(ENDPOINT, "c1", b"{}")
    assert timed_out.posts == 1
    # AND a post that could not connect is sent again
    unreachable = FlakyManagement(EndpointConnectionError(endpoint_url=ENDPOINT))
    ApiGatewayPoster(lambda _: unreachable).post(ENDPOINT, "c1", b"{}")
    assert unreachable.posts == 2
    # AND so is one whose connection closed before any answer (an idle kept-alive one)
    closed = FlakyManagement(ConnectionClosedError(endpoint_url=ENDPOINT))
    ApiGatewayPoster(lambda _: closed).post(ENDPOINT, "c1", b"{}")
    assert closed.posts == 2


class FailingPoster(MemoryPoster):
    """Fails its first ``failures`` posts with an error the poster does not retry."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def post(self, endpoint: str, connection_id: str, data: bytes) -> None:
        with self.lock:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("the management API answered 500")
        super().post(endpoint, connection_id, data)


@pytest.mark.parametrize("failures", [1, 2], ids=["its own push", "and the first retry"])
def test_an_answer_whose_push_failed_is_delivered_again_without_another_frame(
    failures: int,
) -> None:
    # GIVEN two tenants' connections, each client waiting for an answer before it sends more
    h = harness()
    h.gateway.retry_pauses_s = (0.0, 0.0, 0.0)
    failing = FailingPoster(failures)
    h.gateway.poster = failing
    h.connect("c1")
    h.connect("c2", "key-globex")
    # WHEN acme's seq 0 is answered but its push fails (and the first retry, too)
    h.frame("c1", id="a0", seq=0, model="echo", inputs=INPUTS)
    # THEN the same invocation pushed it again: once, in its place, nothing left held
    assert [(a["id"], a["seq"]) for a in failing.answers("c1")] == [("a0", 0)]
    stats = h.store.get("c1", 0)
    assert stats is not None
    assert (stats.next_seq, stats.in_flight, stats.pending) == (1, 0, {})
    # AND the other tenant's stream is untouched; its frame without seq, whose push fails
    # as often, is pushed again too
    failing.failures = failures
    h.frame("c2", id="g0", model="echo", inputs=INPUTS)
    assert [a["id"] for a in failing.answers("c2")] == ["g0"]
    assert [a["id"] for a in failing.answers("c1")] == ["a0"]


def test_a_duplicate_seq_and_one_past_the_window_are_refused_at_once() -> None:
    h = harness(max_in_flight=4)
    h.connect("c1")
    h.router.gates["f1"] = threading.Event()
    # GIVEN seq 0 answered, seq 2 held waiting for seq 1, and seq 1 in the router
    h.frame("c1", id="f0", seq=0, model="echo", inputs=INPUTS)
    h.frame("c1", id="f2", seq=2, model="echo", inputs=INPUTS)
    (slow,) = in_threads(lambda: h.frame("c1", id="f1", seq=1, model="echo", inputs=INPUTS))
    wait_until(lambda: len(h.router.calls) == 3)
    # WHEN seq 0 and seq 2 come again, and seq 5 (next_seq 1 + window 4) arrives
    h.frame("c1", id="again0", seq=0, model="echo", inputs=INPUTS)
    h.frame("c1", id="again2", seq=2, model="echo", inputs=INPUTS)
    h.frame("c1", id="far", seq=5, model="echo", inputs=INPUTS)
    # THEN each is refused at once and not processed
    refused = [(a["id"], a["seq"], a["code"], a["status"]) for a in h.answers("c1")[1:]]
    assert refused == [
        ("again0", 0, "duplicate_seq", 409),
        ("again2", 2, "duplicate_seq", 409),
        ("far", 5, "seq_out_of_window", 400),
    ]
    assert len(h.router.calls) == 3
    # AND when seq 1 finishes, seq 1 and the held seq 2 follow, once each
    h.router.gates["f1"].set()
    slow.join(30)
    assert [a["id"] for a in h.answers("c1")] == ["f0", "again0", "again2", "far", "f1", "f2"]
    stats = h.store.get("c1", 0)
    assert stats is not None
    assert (stats.in_flight, stats.counters["frames_refused"], stats.counters["frames_in"]) == (
        0,
        3,
        6,
    )


# --- back-pressure ---------------------------------------------------------------------------


def test_a_frame_past_the_bound_is_told_to_slow_down_and_served_when_sent_again() -> None:
    # GIVEN a bound of 2 and two frames in flight (one in the router, one held for order)
    h = harness(max_in_flight=2)
    h.connect("c1")
    h.router.gates["f0"] = threading.Event()
    (slow,) = in_threads(lambda: h.frame("c1", id="f0", seq=0, model="echo", inputs=INPUTS))
    wait_until(lambda: len(h.router.calls) == 1)
    h.frame("c1", id="f1", seq=1, model="echo", inputs=INPUTS)
    # WHEN a third frame arrives
    h.frame("c1", id="f2", seq=2, model="echo", inputs=INPUTS)
    # THEN it is answered at once with slow_down, not processed
    assert h.answers("c1") == [
        {
            "id": "f2",
            "seq": 2,
            "error": "too many frames in flight on this connection (limit 2): "
            "wait for answers before sending more",
            "code": "slow_down",
            "status": 429,
            "in_flight": 2,
            "limit": 2,
        }
    ]
    assert len(h.router.calls) == 2
    # AND after the answers arrive, the same frame sent again is served in its place
    h.router.gates["f0"].set()
    slow.join(30)
    h.frame("c1", id="f2", seq=2, model="echo", inputs=INPUTS)
    assert [(a["id"], a.get("code")) for a in h.answers("c1")] == [
        ("f2", "slow_down"),
        ("f0", None),
        ("f1", None),
        ("f2", None),
    ]
    stats = h.store.get("c1", 0)
    assert stats is not None
    assert (
        stats.counters["frames_in"],
        stats.counters["frames_refused"],
        stats.counters["frames_answered"],
    ) == (4, 1, 3)


# --- closing ------------------------------------------------------------------------------------


def test_disconnect_deletes_the_state_and_reports_the_counters(h: Harness) -> None:
    h.connect("c1")
    h.frame("c1", id="f0", seq=0, model="echo", inputs=INPUTS)
    h.frame("c1", id="f2", seq=2, model="echo", inputs=INPUTS)  # held: seq 1 never came
    assert h.gateway.handle(ws_event("$disconnect", "c1")) == {"statusCode": 200}
    assert "c1" not in h.store.items
    assert h.store.held_items == {}
    (last,) = h.closed
    assert (last.counters["frames_in"], last.counters["frames_answered"], last.in_flight) == (
        2,
        2,
        1,
    )


def test_a_gone_connection_is_cleaned_up_when_an_answer_meets_410(h: Harness) -> None:
    # GIVEN a connection with an answer held, whose client vanished without $disconnect
    h.connect("c1")
    h.frame("c1", id="f1", seq=1, model="echo", inputs=INPUTS)
    h.poster.gone.add("c1")
    # WHEN the next answer is pushed and meets 410 Gone
    h.frame("c1", id="f0", seq=0, model="echo", inputs=INPUTS)
    # THEN the connection's item and held answers are deleted, its counters reported once
    assert "c1" not in h.store.items
    assert h.store.held_items == {}
    assert len(h.closed) == 1
    # AND a later frame is not_connected (nothing pushed: the connection is gone)
    h.frame("c1", id="f2", seq=2, model="echo", inputs=INPUTS)
    assert len(h.closed) == 1


def test_the_real_router_s_error_reaches_the_frame_with_its_code() -> None:
    # GIVEN the router built from its settings, its backends answering 404 for one model
    def send(request: BackendRequest, timeout_s: float) -> BackendResponse:
        if request.path.startswith("/v2/models/gone/"):
            body = b'{"error":"unknown model \'gone\'","code":"model_not_found"}'
            return BackendResponse(404, {"content-type": "application/json"}, body, 0.01)
        return BackendResponse(
            200, {"content-type": "application/json"}, b'{"model_name":"m","outputs":[]}', 0.01
        )

    backend = type("Backend", (), {"send": staticmethod(send)})
    backends: dict[str, Any] = {"gpu": backend(), "cpu": backend()}
    app = create_app(RouterSettings(), fake_overrides(backends, lambda: 1.0, io.StringIO()))
    h = harness(app.router)
    h.connect("c1")
    # WHEN frames ask for the missing model and a served one
    h.frame("c1", id="a", seq=0, model="gone", inputs=INPUTS)
    h.frame("c1", id="b", seq=1, model="m", inputs=INPUTS)
    # THEN the first answer is the router's 404 with its code, the second a success
    first, second = h.answers("c1")
    assert (first["code"], first["status"], first["seq"]) == ("model_not_found", 404, 0)
    assert second["spillway"]["backend"] == "gpu"
    assert second["spillway"]["rule"]


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = threading.active_count()
    yield
    wait_until(lambda: threading.active_count() <= before)
