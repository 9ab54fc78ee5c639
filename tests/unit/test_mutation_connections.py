"""A WebSocket connection's state on its own, value by value (what the mutation run of
spillway/streams/connections.py found reached only through the gateway, or not at all:
docs/mutation.md): its counters and stats, the lease, held answers, the admission window
and the keys of its items."""

from __future__ import annotations

import pytest

from spillway.protocol.errors import InvalidInputError
from spillway.streams.connections import (
    DUPLICATE,
    HELD,
    OUT_OF_WINDOW,
    SLOW_DOWN,
    Admission,
    Connection,
    connection_key,
    held_key,
)


def connection(**fields: object) -> Connection:
    return Connection(id="c1", tenant="acme", connected_at=100.0, **fields)  # type: ignore[arg-type]


def test_stats_give_every_counter_whole_numbers_as_integers() -> None:
    # GIVEN a connection with some counters, a cost in cents and one backend count
    conn = connection(
        counters={"in_flight": 2.0, "frames_in": 5.0, "bytes_in": 300.0, "cost_usd": 0.25},
        backends={"gpu": 4},
    )
    # THEN the stats list every counter (0 when never counted), whole numbers as int
    stats = conn.stats()
    assert stats == {
        "connected_at": 100.0,
        "tenant": "acme",
        "in_flight": 2,
        "frames_in": 5,
        "frames_answered": 0,
        "frames_failed": 0,
        "frames_refused": 0,
        "bytes_in": 300,
        "bytes_out": 0,
        "cost_usd": 0.25,
        "backends": {"gpu": 4},
    }
    assert isinstance(stats["frames_in"], int)
    assert isinstance(stats["cost_usd"], float)
    # AND a copy of the backends, not the connection's own
    stats["backends"]["cpu"] = 1
    assert conn.backends == {"gpu": 4}


def test_in_flight_is_the_counter_or_zero() -> None:
    assert connection().in_flight == 0
    assert connection(counters={"in_flight": 3.0}).in_flight == 3
    assert Admission(connection(counters={"in_flight": 3.0})).in_flight == 3


def test_an_admission_is_admitted_only_without_a_refusal() -> None:
    assert Admission(connection()).admitted is True
    assert Admission(connection(), SLOW_DOWN).admitted is False


def test_the_next_answer_is_held_only_when_its_entry_says_held() -> None:
    assert connection(next_seq=3, pending={3: HELD}).next_is_held() is True
    assert connection(next_seq=3, pending={3: "token", 4: HELD}).next_is_held() is False
    assert connection(next_seq=3).next_is_held() is False


def test_a_connection_serves_while_a_pending_frame_is_not_held() -> None:
    assert connection(pending={3: HELD, 4: "token"}).serving() is True
    assert connection(pending={3: HELD, 4: HELD}).serving() is False
    assert connection().serving() is False


@pytest.mark.parametrize(
    ("owner", "until", "asker", "now", "leased"),
    [
        (None, 200.0, "a", 150.0, False),  # no lease
        ("a", 200.0, "a", 150.0, False),  # the asker's own
        ("b", 200.0, "a", 150.0, True),  # another's, running
        ("b", 200.0, "a", 200.0, False),  # another's, ending now
        ("b", 200.0, "a", 250.0, False),  # another's, ended
    ],
)
def test_only_another_owners_running_lease_counts(
    owner: str | None, until: float, asker: str, now: float, leased: bool
) -> None:
    assert connection(lease_owner=owner, lease_until=until).leased(asker, now) is leased


@pytest.mark.parametrize(
    ("in_flight", "seq", "refusal"),
    [
        (1, None, None),
        (2, None, SLOW_DOWN),  # at the limit of 2
        (2, 10, None),  # the frame every held answer waits for is never slowed down
        (2, 11, SLOW_DOWN),
        (1, 11, None),
        (1, 12, OUT_OF_WINDOW),  # the window is next_seq .. next_seq + limit - 1
        (1, 9, DUPLICATE),  # already delivered
        (1, 13, OUT_OF_WINDOW),
    ],
)
def test_the_admission_window(in_flight: int, seq: int | None, refusal: str | None) -> None:
    conn = connection(next_seq=10, counters={"in_flight": float(in_flight)})
    assert conn.refusal(seq, limit=2) == refusal


def test_a_seq_in_flight_is_a_duplicate() -> None:
    conn = connection(next_seq=10, counters={"in_flight": 1.0}, pending={11: "token"})
    assert conn.refusal(11, limit=4) == DUPLICATE
    assert conn.refusal(12, limit=4) is None


def test_item_keys_and_plain_connection_ids() -> None:
    assert connection_key("Ab0._:=+/-x") == "wsconn#Ab0._:=+/-x"
    assert held_key("c1", 7) == "wsheld#c1#7"
    assert connection_key("x" * 128) == "wsconn#" + "x" * 128


@pytest.mark.parametrize("bad", ["", "x" * 129, "a b", "a#b", "ü"])
def test_a_connection_id_that_is_not_plain_is_refused(bad: str) -> None:
    with pytest.raises(InvalidInputError) as refused:
        connection_key(bad)
    assert refused.value.message == "not a WebSocket connection id"
    with pytest.raises(InvalidInputError, match="not a WebSocket connection id"):
        held_key(bad, 1)
