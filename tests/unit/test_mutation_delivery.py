"""What the mutation run of spillway/streams/delivery.py found unchecked in the poster
(docs/mutation.md): the management API client's settings, which failures of a post are
sent again (and after which pauses, how often), a gone connection, one client per
endpoint, and the state-table calls made again while the table cannot be reached."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
)

from spillway.protocol.errors import StateUnavailableError
from spillway.streams import delivery
from spillway.streams.connections import HELD, Connection
from spillway.streams.delivery import (
    AnswerDelivery,
    ApiGatewayPoster,
    ConnectionGone,
    RetryingStore,
)
from spillway.streams.frames import Answer, Frame
from spillway.streams.settings import StreamSettings

ENDPOINT = "https://abc.execute-api.us-east-1.amazonaws.com/prod"


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PostToConnection",
    )


class Management:
    """``post_to_connection`` failing with the given errors first, then taking posts."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.posts: list[tuple[str, bytes]] = []

    def post_to_connection(self, ConnectionId: str, Data: bytes) -> None:
        self.posts.append((ConnectionId, Data))
        if self.errors:
            raise self.errors.pop(0)


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pauses the poster takes between attempts (not slept)."""
    taken: list[float] = []
    monkeypatch.setattr("spillway.streams.delivery.time.sleep", taken.append)
    return taken


def test_the_management_client_never_retries_a_post_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def client(*args: Any, **kwargs: Any) -> str:
        made.append((args, kwargs))
        return "client"

    monkeypatch.setattr("spillway.aws.clients.client", client)
    assert delivery._management_client(ENDPOINT) == "client"
    assert made == [
        (
            ("apigatewaymanagementapi",),
            {
                "endpoint_url": ENDPOINT,
                "connect_timeout": 1,
                "read_timeout": 5,
                "max_attempts": None,
                "total_max_attempts": 1,
                "retry_mode": None,
                "max_pool_connections": 64,
            },
        )
    ]


def test_a_post_that_arrives_is_posted_once_with_its_data(pauses: list[float]) -> None:
    management = Management()
    ApiGatewayPoster(lambda _: management).post(ENDPOINT, "c1", b'{"id": 1}')
    assert management.posts == [("c1", b'{"id": 1}')]
    assert pauses == []


@pytest.mark.parametrize(
    "error",
    [
        EndpointConnectionError(endpoint_url=ENDPOINT),
        ConnectionClosedError(endpoint_url=ENDPOINT),
        client_error("LimitExceededException", 429),
    ],
    ids=["unreachable", "closed", "throttled"],
)
def test_a_post_that_was_not_taken_is_sent_again_after_growing_pauses(
    error: Exception, pauses: list[float]
) -> None:
    # GIVEN a post refused twice
    management = Management(error, error)
    # WHEN it is posted THEN the third attempt takes it, after 50 ms and 100 ms
    ApiGatewayPoster(lambda _: management).post(ENDPOINT, "c1", b"{}")
    assert len(management.posts) == 3
    assert pauses == [pytest.approx(0.05), pytest.approx(0.1)]


@pytest.mark.parametrize(
    "error",
    [
        EndpointConnectionError(endpoint_url=ENDPOINT),
        ConnectionClosedError(endpoint_url=ENDPOINT),
        client_error("LimitExceededException", 429),
    ],
    ids=["unreachable", "closed", "throttled"],
)
def test_a_post_refused_three_times_raises_the_last_refusal(
    error: Exception, pauses: list[float]
) -> None:
    management = Management(error, error, error, error)
    with pytest.raises(type(error)) as raised:
        ApiGatewayPoster(lambda _: management).post(ENDPOINT, "c1", b"{}")
    assert raised.value is error
    assert len(management.posts) == 3
    assert len(pauses) == 2


def test_a_post_whose_answer_timed_out_counts_as_pushed(pauses: list[float]) -> None:
    management = Management(ReadTimeoutError(endpoint_url=ENDPOINT))
    ApiGatewayPoster(lambda _: management).post(ENDPOINT, "c1", b"{}")
    assert len(management.posts) == 1
    assert pauses == []


@pytest.mark.parametrize(
    ("code", "status"), [("GoneException", 410), ("GoneException", 400), ("Other", 410)]
)
def test_a_gone_connection_is_connection_gone_at_once(
    code: str, status: int, pauses: list[float]
) -> None:
    management = Management(client_error(code, status))
    with pytest.raises(ConnectionGone) as gone:
        ApiGatewayPoster(lambda _: management).post(ENDPOINT, "c1", b"{}")
    assert gone.value.args == ("c1",)
    assert isinstance(gone.value.__cause__, ClientError)
    assert len(management.posts) == 1
    assert pauses == []


@pytest.mark.parametrize("status", [400, 403, 500])
def test_any_other_refusal_is_raised_at_once(status: int, pauses: list[float]) -> None:
    error = client_error("BadRequestException", status)
    management = Management(error)
    with pytest.raises(ClientError) as raised:
        ApiGatewayPoster(lambda _: management).post(ENDPOINT, "c1", b"{}")
    assert raised.value is error
    assert len(management.posts) == 1
    assert pauses == []


def test_one_client_per_endpoint(pauses: list[float]) -> None:
    made: list[str] = []

    def factory(endpoint: str) -> Management:
        made.append(endpoint)
        return Management()

    poster = ApiGatewayPoster(factory)
    for endpoint in (ENDPOINT, ENDPOINT, "https://other/prod", ENDPOINT):
        poster.post(endpoint, "c1", b"{}")
    assert made == [ENDPOINT, "https://other/prod"]


class _Table:
    """A store whose ``get`` fails ``failures`` times, then answers its arguments."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def get(self, connection_id: str, now: float) -> tuple[str, float]:
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise StateUnavailableError("table down")
        return connection_id, now


def test_state_table_calls_are_made_again_after_each_pause(pauses: list[float]) -> None:
    table = _Table(failures=2)
    store = RetryingStore(table, (0.1, 0.2, 0.4))  # type: ignore[arg-type]
    assert store.get("c1", now=5.0) == ("c1", 5.0)
    assert table.calls == 3
    assert pauses == [0.1, 0.2]


def test_a_state_table_call_failing_past_every_pause_raises(pauses: list[float]) -> None:
    table = _Table(failures=3)
    store = RetryingStore(table, (0.1, 0.2))  # type: ignore[arg-type]
    with pytest.raises(StateUnavailableError):
        store.get("c1", now=5.0)  # the last call keeps its keywords too
    assert table.calls == 3
    assert pauses == [0.1, 0.2]


# -- AnswerDelivery's pushes --------------------------------------------------------------


@dataclass
class _Where:
    connection_id: str = "c1"
    endpoint: str = ENDPOINT


class _Poster:
    """Fails its first ``failures`` posts with ``error``; records every post."""

    def __init__(self, failures: int = 0, error: Exception | None = None) -> None:
        self.failures, self.error = failures, error or RuntimeError("500 from the API")
        self.posts: list[tuple[str, str, bytes]] = []

    def post(self, endpoint: str, connection_id: str, data: bytes) -> None:
        self.posts.append((endpoint, connection_id, data))
        if self.failures:
            self.failures -= 1
            raise self.error


class _Delivery(AnswerDelivery):
    """The delivering half alone, at a fixed time, recording the connections it closes
    and (when ``delivers`` is set) the deliveries ``_deliver_again`` makes."""

    def __init__(self, poster: _Poster, delivers: bool | None = None) -> None:
        self.poster = poster
        self.settings = StreamSettings(max_message_bytes=1024)
        self.clock = lambda: 100.0
        self.closed: list[tuple[object, str, str]] = []
        self.delivers, self.deliveries = delivers, 0
        self.delivered_for: list[tuple[Any, Any]] = []  # (owner, hand_over_at) of each

    def _close(self, store: Any, where: Any, why: str) -> None:
        self.closed.append((store, where.connection_id, why))

    def _deliver(self, *args: Any, **kwargs: Any) -> bool:
        if self.delivers is None:
            return super()._deliver(*args, **kwargs)
        self.deliveries += 1
        owner, hand_over_at = args[2], args[4] if len(args) > 4 else kwargs.get("hand_over_at")
        self.delivered_for.append((owner, hand_over_at))
        return self.delivers


ANSWER = Answer({"id": "f1", "outputs": []}, ok=True)


def test_an_answer_without_seq_is_pushed_at_once(pauses: list[float]) -> None:
    poster = _Poster()
    sent = _Delivery(poster)._push("store", _Where(), ANSWER)  # type: ignore[arg-type]
    assert sent == len(ANSWER.data)
    assert poster.posts == [(ENDPOINT, "c1", ANSWER.data)]
    assert pauses == [0.0]


def test_a_failed_push_is_made_again_after_each_pause(pauses: list[float]) -> None:
    poster = _Poster(failures=2)
    sent = _Delivery(poster)._push("store", _Where(), ANSWER)  # type: ignore[arg-type]
    assert sent == len(ANSWER.data)
    assert len(poster.posts) == 3
    assert pauses == [0.0, 0.25, 0.5]


def test_an_answer_whose_every_push_failed_is_logged_lost(
    pauses: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    poster = _Poster(failures=100)
    with caplog.at_level(logging.INFO, logger="spillway.streams"):
        sent = _Delivery(poster)._push("store", _Where(), ANSWER)  # type: ignore[arg-type]
    assert sent == 0
    assert pauses == [0.0, 0.25, 0.5, 1.0, 2.0, 4.0]
    assert len(poster.posts) == 6
    logged = [
        (r.levelno, r.getMessage(), getattr(r, "connection_id", None)) for r in caplog.records
    ]
    assert logged == [(logging.ERROR, "push failed", "c1")] * 6 + [
        (logging.ERROR, "answer lost: its pushes failed", "c1")
    ]
    assert all(r.exc_info is not None for r in caplog.records[:6])


def test_a_push_to_a_gone_connection_closes_it(pauses: list[float]) -> None:
    delivery_ = _Delivery(_Poster(failures=1, error=ConnectionGone("c1")))
    assert delivery_._push("store", _Where(), ANSWER) == 0  # type: ignore[arg-type]
    assert delivery_.closed == [("store", "c1", "gone")]
    assert pauses == [0.0]


def test_an_answer_over_the_message_limit_is_replaced_by_its_413() -> None:
    poster = _Poster()
    big = Answer({"id": "f1", "seq": 4, "outputs": ["x" * 2000]}, ok=True)
    sent = _Delivery(poster)._post(_Where(), big.data)
    [(_, _, data)] = poster.posts
    assert sent == len(data)
    refused = json.loads(data)
    assert (refused["id"], refused["seq"], refused["status"]) == ("f1", 4, 413)
    assert refused["error"] == (
        f"answer of {len(big.data)} bytes exceeds the WebSocket message limit of 1024 bytes; "
        "send larger inputs through the REST API"
    )
    # AND one at the limit goes as it is
    assert _Delivery(poster)._post(_Where(), b"x" * 1024) == 1024
    assert poster.posts[-1][2] == b"x" * 1024


class _Store:
    def __init__(self) -> None:
        self.gets: list[tuple[str, float]] = []

    def get(self, connection_id: str, now: float) -> None:
        self.gets.append((connection_id, now))


def test_held_answers_are_delivered_again_after_a_pause_until_one_delivery_holds(
    pauses: list[float],
) -> None:
    # GIVEN deliveries that go through
    delivery_, store = _Delivery(_Poster(), delivers=True), _Store()
    # WHEN a failed push is followed up THEN one pause, one fresh read, one delivery
    delivery_._deliver_again(store, _Where(), "owner", None)  # type: ignore[arg-type]
    assert pauses == [0.25]
    assert store.gets == [("c1", 100.0)]
    assert delivery_.deliveries == 1
    assert delivery_.delivered_for == [("owner", None)]


def test_held_answers_whose_deliveries_keep_failing_are_left_held_and_logged(
    pauses: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    delivery_, store = _Delivery(_Poster(), delivers=False), _Store()
    with caplog.at_level(logging.ERROR, logger="spillway.streams"):
        delivery_._deliver_again(store, _Where(), "owner", None)  # type: ignore[arg-type]
    assert pauses == [0.25, 0.5, 1.0, 2.0, 4.0]
    assert delivery_.deliveries == 5
    assert [(r.getMessage(), getattr(r, "connection_id", None)) for r in caplog.records] == [
        ("answer left held: its pushes failed", "c1")
    ]


def test_no_pause_may_pass_the_invocations_end(
    pauses: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    # GIVEN an invocation handing over at 97 s, so ending at 101 s (a 4 s reserve); now 100 s
    delivery_, store = _Delivery(_Poster(), delivers=False), _Store()
    with caplog.at_level(logging.ERROR, logger="spillway.streams"):
        delivery_._deliver_again(store, _Where(), "owner", 97.0)  # type: ignore[arg-type]
    # THEN it pauses 0.25 s and 0.5 s, not the 1 s that would reach its end
    assert pauses == [0.25, 0.5]
    assert delivery_.delivered_for == [("owner", 97.0), ("owner", 97.0)]
    # AND the answers left held are logged
    assert [r.getMessage() for r in caplog.records] == ["answer left held: its pushes failed"]


# -- settling and delivering held answers, against a scripted store -----------------------


class _Scripted:
    """A connection store that answers as scripted and records every call."""

    def __init__(
        self,
        *,
        claims: list[bool] | None = None,
        finished: list[Connection | None] | None = None,
        held: dict[int, bytes] | None = None,
    ) -> None:
        self.claims = list(claims) if claims is not None else [True] * 10
        self.finished = list(finished) if finished is not None else [None]
        self.held_data = dict(held or {})
        self.calls: list[tuple[Any, ...]] = []

    def claim(self, *args: Any) -> bool:
        self.calls.append(("claim", *args))
        return self.claims.pop(0)

    def finish(self, *args: Any, **kwargs: Any) -> Connection | None:
        self.calls.append(("finish", *args, kwargs))
        return self.finished.pop(0)

    def held(self, *args: Any) -> bytes | None:
        self.calls.append(("held", *args))
        return self.held_data.get(args[1])

    def hold(self, *args: Any) -> Connection | None:
        self.calls.append(("hold", *args))
        return None

    def release(self, *args: Any) -> None:
        self.calls.append(("release", *args))

    def count(self, *args: Any) -> None:
        self.calls.append(("count", *args))

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


def _held(next_seq: int, *, serving: bool = False, **fields: Any) -> Connection:
    pending: dict[int, str] = {next_seq: HELD}
    if serving:
        pending[next_seq + 1] = "token"
    return Connection(
        id="c1", tenant="acme", connected_at=0.0, next_seq=next_seq, pending=pending, **fields
    )


def _records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str, Any, Any]]:
    return [
        (r.levelno, r.getMessage(), getattr(r, "connection_id", None), getattr(r, "seq", None))
        for r in caplog.records
    ]


def test_a_held_next_answer_is_claimed_posted_and_finished(pauses: list[float]) -> None:
    poster = _Poster()
    store = _Scripted(held={3: b"held-3"}, finished=[_held(4, lease_owner="me", lease_until=200.0)])
    store.held_data[4] = b"held-4"
    store.finished.append(None)
    delivered = _Delivery(poster)._deliver(store, _Where(), "me", _held(3))
    assert delivered is True
    assert [p[2] for p in poster.posts] == [b"held-3", b"held-4"]  # its own lease: goes on
    assert store.calls[:3] == [
        ("held", "c1", 3, 100.0),
        ("claim", "c1", 3, "me", 100.0, 130.0),
        ("finish", "c1", 3, "me", 100.0, {"bytes_out": 6}, {}),
    ]


def test_no_held_answer_and_another_owners_lease_leave_it_be() -> None:
    store = _Scripted()
    delivery_ = _Delivery(_Poster())
    assert delivery_._deliver(store, _Where(), "me", None) is True
    other = _held(3, lease_owner="other", lease_until=101.0)
    assert delivery_._deliver(store, _Where(), "me", other) is True
    assert store.calls == []


def test_held_answers_are_handed_over_from_the_hand_over_time_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _Scripted()
    with caplog.at_level(logging.DEBUG, logger="spillway.streams"):
        handed = _Delivery(_Poster())._deliver(
            store,
            _Where(),
            "me",
            _held(3, serving=True),
            100.0,
        )
    assert handed is True
    assert store.calls == []
    assert _records(caplog) == [(logging.INFO, "held answers handed over", "c1", None)]
    assert getattr(caplog.records[0], "next_seq", None) == 3


@pytest.mark.parametrize(
    ("scripted", "message"),
    [
        ({"held": {}}, "held answer already pushed"),
        ({"held": {3: b"x"}, "claims": [False]}, "delivery left to the lease holder"),
    ],
    ids=["pushed-meanwhile", "lease-taken"],
)
def test_a_held_answer_someone_else_delivers_is_left_to_them(
    scripted: dict[str, Any], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = _Scripted(**scripted)  # a fresh store per run
    poster = _Poster()
    with caplog.at_level(logging.DEBUG, logger="spillway.streams"):
        left = _Delivery(poster)._deliver(store, _Where(), "me", _held(3))
    assert left is True
    assert poster.posts == []
    assert _records(caplog) == [(logging.DEBUG, message, "c1", 3)]


def test_a_held_answer_for_a_gone_connection_closes_it() -> None:
    delivery_ = _Delivery(_Poster(failures=1, error=ConnectionGone("c1")))
    store = _Scripted(held={3: b"x"})
    assert delivery_._deliver(store, _Where(), "me", _held(3)) is True
    assert delivery_.closed == [(store, "c1", "gone")]
    assert "finish" not in store.names()


def test_a_held_answer_whose_post_failed_stays_held_and_the_lease_is_given_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _Scripted(held={3: b"x"})
    with caplog.at_level(logging.DEBUG, logger="spillway.streams"):
        ok = _Delivery(_Poster(failures=1))._deliver(store, _Where(), "me", _held(3))
    assert ok is False
    assert store.calls[-1] == ("release", "c1", "me")
    assert _records(caplog) == [(logging.ERROR, "push failed", "c1", None)]
    assert caplog.records[0].exc_info is not None


def test_a_lease_lost_during_a_delivery_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    store = _Scripted(held={3: b"x"}, finished=[None])
    with caplog.at_level(logging.DEBUG, logger="spillway.streams"):
        ok = _Delivery(_Poster())._deliver(store, _Where(), "me", _held(3))
    assert ok is True
    assert _records(caplog) == [(logging.WARNING, "delivery lease lost", "c1", 3)]


def _frame(seq: int | None) -> Frame:
    return Frame(id="f1", seq=seq, action="infer", header={})


ANSWERED = Answer({"id": "f1", "outputs": []}, ok=True, cost_usd=0.5, backend="gpu")


def test_an_answer_without_seq_is_pushed_and_counted(pauses: list[float]) -> None:
    store = _Scripted()
    _Delivery(_Poster())._settle(store, _frame(None), ANSWERED, _Where(), None)  # type: ignore[arg-type]
    assert store.calls == [
        (
            "count",
            "c1",
            {
                "frames_answered": 1.0,
                "cost_usd": 0.5,
                "in_flight": -1,
                "bytes_out": len(ANSWERED.data),
            },
            "gpu",
        )
    ]


def test_a_next_answer_is_claimed_for_a_lease_posted_and_finished_not_held() -> None:
    store = _Scripted(finished=[Connection(id="c1", tenant=None, connected_at=0.0, next_seq=6)])
    _Delivery(_Poster())._settle(store, _frame(5), ANSWERED, _Where(), None)  # type: ignore[arg-type]
    claim, finish = store.calls
    assert claim[:3] == ("claim", "c1", 5)
    owner = claim[3]
    assert len(owner) == 24
    assert claim[4:] == (100.0, 130.0)
    counts = {"frames_answered": 1.0, "cost_usd": 0.5, "bytes_out": len(ANSWERED.data)}
    assert finish == ("finish", "c1", 5, owner, 100.0, counts, "gpu", {"held": False})


def test_a_next_answer_for_a_gone_connection_closes_it() -> None:
    delivery_ = _Delivery(_Poster(failures=1, error=ConnectionGone("c1")))
    store = _Scripted()
    delivery_._settle(store, _frame(5), ANSWERED, _Where(), None)  # type: ignore[arg-type]
    assert delivery_.closed == [(store, "c1", "gone")]


class _Again(_Delivery):
    """Records the follow-ups ``_settle`` asks for instead of making them."""

    def __init__(self, poster: _Poster, delivers: bool | None = None) -> None:
        super().__init__(poster, delivers)
        self.again: list[tuple[Any, ...]] = []

    def _deliver_again(self, *args: Any) -> None:
        self.again.append(args)


def test_a_next_answer_whose_post_failed_is_held_and_delivered_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    delivery_, store = _Again(_Poster(failures=1)), _Scripted()
    with caplog.at_level(logging.DEBUG, logger="spillway.streams"):
        delivery_._settle(store, _frame(5), ANSWERED, _Where(), 90.0)  # type: ignore[arg-type]
    owner = store.calls[0][3]
    assert store.names() == ["claim", "hold", "release"]
    assert store.calls[1] == (
        "hold",
        "c1",
        5,
        ANSWERED.data,
        100.0,
        900,
        {"frames_answered": 1.0, "cost_usd": 0.5},
        "gpu",
    )
    assert store.calls[2] == ("release", "c1", owner)
    assert delivery_.again == [(store, _Where(), owner, 90.0)]
    assert _records(caplog) == [(logging.ERROR, "push failed", "c1", None)]


def test_a_next_answer_whose_lease_was_lost_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    store = _Scripted(finished=[None])
    with caplog.at_level(logging.DEBUG, logger="spillway.streams"):
        _Delivery(_Poster())._settle(store, _frame(5), ANSWERED, _Where(), None)  # type: ignore[arg-type]
    assert _records(caplog) == [(logging.WARNING, "delivery lease lost", "c1", None)]


def test_an_answer_not_next_is_held_and_its_failed_delivery_followed_up() -> None:
    delivery_, store = _Again(_Poster(), delivers=False), _Scripted(claims=[False])
    delivery_._settle(store, _frame(5), ANSWERED, _Where(), 90.0)  # type: ignore[arg-type]
    owner = store.calls[0][3]
    assert store.names() == ["claim", "hold"]
    assert delivery_.delivered_for == [(owner, 90.0)]
    assert delivery_.again == [(store, _Where(), owner, 90.0)]


def test_a_failed_state_table_call_is_logged_with_its_name(
    pauses: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    table = _Table(failures=1)
    store = RetryingStore(table, (0.1,))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="spillway.streams"):
        assert store.get("c1", now=5.0) == ("c1", 5.0)
    assert [(r.getMessage(), getattr(r, "call", None)) for r in caplog.records] == [
        ("state table call failed: trying again", "get")
    ]


def test_a_post_whose_answer_timed_out_is_logged(
    pauses: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    management = Management(ReadTimeoutError(endpoint_url=ENDPOINT))
    with caplog.at_level(logging.WARNING, logger="spillway.streams"):
        ApiGatewayPoster(lambda _: management).post(ENDPOINT, "c1", b"{}")
    assert _records(caplog) == [(logging.WARNING, "post timed out: counted as pushed", "c1", None)]
