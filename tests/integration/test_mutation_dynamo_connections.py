"""The DynamoDB connection store's writes and reads, attribute by attribute (a moto server
on 127.0.0.1), for its mutation run (docs/mutation.md): what each write leaves in the item,
what a read makes of an item that lacks an attribute or holds one of another type, the
TTL attribute of held answers, the lease, ``withdraw``, the exact range of held answers
``close`` deletes and its retries of unprocessed deletes, and the failures a write
answered strangely raises.

The client is the real one behind a thin wrapper (``_Client``) that records each call
and, where a test asks, answers as DynamoDB does under throttling, or refuses an empty
``ExpressionAttributeNames`` map as DynamoDB does (moto accepts it)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from spillway.protocol.errors import StateUnavailableError
from spillway.state.table import DynamoStateStore, create_table
from spillway.streams.connections import COUNTERS, Connection, held_key
from spillway.streams.dynamo_connections import DynamoConnections

NOW = 1_800_000_000.0


def _real() -> Any:
    import boto3

    return boto3.client("dynamodb")


def _client_error(code: str, message: str, **response: Any) -> Exception:
    from botocore.exceptions import ClientError

    error: Exception = ClientError(
        {"Error": {"Code": code, "Message": message}, **response}, "UpdateItem"
    )
    return error


class _Client:
    """The real DynamoDB client, each call recorded as ``(operation, kwargs)``.

    ``unprocessed``: how many ``batch_write_item`` calls leave all but their first request
    unprocessed (``-1``: every call, none sent). ``refuse_admissions``: every conditional
    ``update_item`` fails its condition on the item as it is (a frame's write that loses
    every race). ``empty_answers``: ``update_item`` answers an empty ``Attributes``."""

    def __init__(self) -> None:
        self.client = _real()
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.unprocessed = 0
        self.refuse_admissions = False
        self.empty_answers = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def named(self, operation: str) -> list[dict[str, Any]]:
        return [kwargs for name, kwargs in self.calls if name == operation]

    def get_item(self, **kwargs: Any) -> Any:
        self.calls.append(("get_item", kwargs))
        return self.client.get_item(**kwargs)

    def put_item(self, **kwargs: Any) -> Any:
        self.calls.append(("put_item", kwargs))
        return self.client.put_item(**kwargs)

    def delete_item(self, **kwargs: Any) -> Any:
        self.calls.append(("delete_item", kwargs))
        return self.client.delete_item(**kwargs)

    def update_item(self, **kwargs: Any) -> Any:
        self.calls.append(("update_item", kwargs))
        if kwargs.get("ExpressionAttributeNames") == {}:
            raise _client_error("ValidationException", "ExpressionAttributeNames must not be empty")
        if self.refuse_admissions and "ConditionExpression" in kwargs:
            found = self.client.get_item(
                TableName=kwargs["TableName"], Key=kwargs["Key"], ConsistentRead=True
            )
            raise _client_error(
                "ConditionalCheckFailedException",
                "The conditional request failed",
                Item=found.get("Item"),
            )
        answer = self.client.update_item(**kwargs)
        return {"Attributes": {}} if self.empty_answers else answer

    def batch_write_item(self, **kwargs: Any) -> Any:
        self.calls.append(("batch_write_item", kwargs))
        ((table, requests),) = kwargs["RequestItems"].items()
        if self.unprocessed == -1:
            return {"UnprocessedItems": {table: requests}}
        if self.unprocessed > 0 and len(requests) > 1:
            self.unprocessed -= 1
            self.client.batch_write_item(RequestItems={table: requests[:1]})
            return {"UnprocessedItems": {table: requests[1:]}}
        return self.client.batch_write_item(**kwargs)


@pytest.fixture
def table(aws_env: str) -> Iterator[str]:
    name = f"state-{uuid.uuid4().hex[:8]}"
    create_table(_real(), name)
    yield name
    _real().delete_table(TableName=name)


@pytest.fixture
def client(table: str) -> _Client:
    return _Client()


@pytest.fixture
def store(table: str, client: _Client) -> DynamoConnections:
    return DynamoConnections(DynamoStateStore(table, lambda: client))


def raw_item(table: str, key: str) -> dict[str, Any] | None:
    found: dict[str, Any] | None = (
        _real().get_item(TableName=table, Key={"pk": {"S": key}}, ConsistentRead=True).get("Item")
    )
    return found


def put_raw(table: str, item: dict[str, Any]) -> None:
    _real().put_item(TableName=table, Item=item)


def deleted_keys(client: _Client) -> list[str]:
    """The keys of every delete request sent in a batch, in order."""
    return [
        request["DeleteRequest"]["Key"]["pk"]["S"]
        for call in client.named("batch_write_item")
        for requests in call["RequestItems"].values()
        for request in requests
    ]


def test_open_writes_every_attribute_and_get_reads_them_back(
    store: DynamoConnections, table: str
) -> None:
    # GIVEN a connection opened at a fractional time
    store.open("c1", "acme", NOW + 0.25, 600)
    # THEN its item holds each attribute under its own name
    item = raw_item(table, "wsconn#c1")
    assert item is not None
    assert item == {
        "pk": {"S": "wsconn#c1"},
        "tenant": {"S": "acme"},
        "connected_at": {"N": "1800000000.25"},
        "expires_at": {"N": str(int(NOW) + 601)},
        "next_seq": {"N": "0"},
        "pending": {"M": {}},
        **{name: {"N": "0"} for name in COUNTERS},
    }
    # AND a read gives the connection back with its id and when it connected
    assert store.get("c1", NOW) == Connection(
        id="c1",
        tenant="acme",
        connected_at=NOW + 0.25,
        next_seq=0,
        counters=dict.fromkeys(COUNTERS, 0.0),
    )


def test_the_lease_is_written_read_back_and_removed(store: DynamoConnections, table: str) -> None:
    # GIVEN a connection WHEN its lease is claimed until a fractional time
    store.open("c1", "acme", NOW, 600)
    assert store.claim("c1", 0, "me", NOW, NOW + 30.5)
    # THEN the item holds the owner and the time, and a read gives them back
    item = raw_item(table, "wsconn#c1")
    assert item is not None
    assert (item["lease_owner"], item["lease_until"]) == ({"S": "me"}, {"N": "1800000030.5"})
    leased = store.get("c1", NOW)
    assert leased is not None
    assert (leased.lease_owner, leased.lease_until) == ("me", NOW + 30.5)
    assert leased.leased("other", NOW)
    # WHEN its owner gives it back THEN both attributes are gone and a read says so
    store.release("c1", "me")
    item = raw_item(table, "wsconn#c1")
    assert item is not None
    assert "lease_owner" not in item
    assert "lease_until" not in item
    free = store.get("c1", NOW)
    assert free is not None
    assert (free.lease_owner, free.lease_until) == (None, 0.0)


def test_an_item_that_lacks_attributes_reads_with_their_defaults(
    store: DynamoConnections, table: str
) -> None:
    # GIVEN an item with only its key and expiry, and one whose attributes have other types
    expires = {"N": str(int(NOW) + 600)}
    put_raw(table, {"pk": {"S": "wsconn#bare"}, "expires_at": expires})
    put_raw(
        table,
        {
            "pk": {"S": "wsconn#odd"},
            "expires_at": expires,
            "tenant": {"N": "7"},
            "lease_owner": {"N": "3"},
            "lease_until": {"N": "12.5"},
            "pending": {"S": "0"},
        },
    )
    # THEN the first reads as a fresh connection: zero counters, no tenant, no lease
    assert store.get("bare", NOW) == Connection(
        id="bare",
        tenant=None,
        connected_at=0.0,
        next_seq=0,
        counters=dict.fromkeys(COUNTERS, 0.0),
        backends={},
        pending={},
        lease_owner=None,
        lease_until=0.0,
    )
    # AND attributes of another type are left out
    odd = store.get("odd", NOW)
    assert odd is not None
    assert (odd.tenant, odd.lease_owner, odd.pending, odd.lease_until) == (None, None, {}, 12.5)


def test_an_item_without_an_expiry_reads_as_expired(store: DynamoConnections, table: str) -> None:
    # GIVEN an item without expires_at (as if it expired at 0)
    put_raw(table, {"pk": {"S": "wsconn#c1"}, "next_seq": {"N": "4"}})
    # THEN it reads as absent, even at time 0
    assert store.get("c1", NOW) is None
    assert store.get("c1", 0.0) is None


def test_held_answers_carry_their_expiry_and_read_as_absent_from_it(
    store: DynamoConnections, table: str
) -> None:
    # GIVEN a connection with seq 1 admitted and its answer held for 900 s
    store.open("c1", "acme", NOW, 600)
    store.admit("c1", 10, 4, NOW, 1, "t1")
    held = store.hold("c1", 1, b"answer", NOW + 0.5, 900, {"frames_answered": 1}, "gpu")
    # THEN the held answer's item holds the bytes and the expiry in whole seconds, up
    assert raw_item(table, held_key("c1", 1)) == {
        "pk": {"S": held_key("c1", 1)},
        "answer": {"B": b"answer"},
        "expires_at": {"N": str(int(NOW) + 901)},
    }
    # AND the connection just after is returned, with its id
    assert held is not None
    assert (held.id, held.pending, held.backends) == ("c1", {1: "held"}, {"gpu": 1})
    assert held.counters["frames_answered"] == 1
    # AND it reads until its expiry, not at it
    assert store.held("c1", 1, NOW + 900) == b"answer"
    assert store.held("c1", 1, NOW + 901) is None
    # AND a held item without an expiry, or whose answer is not bytes, reads as absent
    put_raw(table, {"pk": {"S": held_key("c1", 2)}, "answer": {"B": b"x"}})
    put_raw(
        table,
        {
            "pk": {"S": held_key("c1", 3)},
            "answer": {"S": "x"},
            "expires_at": {"N": str(int(NOW) + 900)},
        },
    )
    assert store.held("c1", 2, NOW) is None
    assert store.held("c1", 2, 0.0) is None
    assert store.held("c1", 3, NOW) is None
    assert store.held("c1", 9, NOW) is None


def test_holding_for_a_gone_connection_creates_nothing(
    store: DynamoConnections, table: str
) -> None:
    # WHEN an answer is held, or counted, for a connection that is gone
    assert store.hold("gone", 0, b"{}", NOW, 900, {"frames_answered": 1}) is None
    store.count("gone", {"frames_in": 1})
    # THEN no connection item is made (the held answer expires by itself)
    assert raw_item(table, "wsconn#gone") is None


def test_every_read_is_consistent(store: DynamoConnections, client: _Client) -> None:
    # GIVEN a connection WHEN it and a held answer are read
    store.open("c1", "acme", NOW, 600)
    store.get("c1", NOW)
    store.held("c1", 0, NOW)
    # THEN both reads were strongly consistent
    reads = client.named("get_item")
    assert [read.get("ConsistentRead") for read in reads] == [True, True]


def test_admissions_return_the_connection_they_saw(store: DynamoConnections, table: str) -> None:
    # GIVEN a connection and a frame of seq 0 admitted without a token
    store.open("c1", "acme", NOW, 600)
    first = store.admit("c1", 10, 2, NOW, 0)
    assert first is not None
    assert (first.connection.id, first.connection.pending, first.in_flight) == ("c1", {0: ""}, 1)
    item = raw_item(table, "wsconn#c1")
    assert item is not None
    assert item["pending"] == {"M": {"0": {"S": ""}}}
    # WHEN seq 1 is admitted and its write is sent again after its first try went through
    assert store.admit("c1", 10, 2, NOW, 1, "b") is not None
    again = store.admit("c1", 10, 2, NOW, 1, "b")
    # THEN the retry is admitted with the connection as its write left it, counted once
    assert again is not None
    assert again.admitted
    assert again.connection.id == "c1"
    assert again.connection.pending == {0: "", 1: "b"}
    assert (again.in_flight, again.connection.counters["frames_in"]) == (2, 2)
    # AND a frame refused is told so with the connection its write was refused on
    refused = store.admit("c1", 10, 2, NOW, None, "c")
    assert refused is not None
    assert (refused.refusal, refused.connection.id, refused.in_flight) == ("slow_down", "c1", 2)


def test_an_admission_refused_without_a_reason_three_times_is_state_unavailable(
    store: DynamoConnections, client: _Client
) -> None:
    # GIVEN a connection with room, whose writes all fail their condition (each lost a race
    # that left no reason to refuse)
    store.open("c1", "acme", NOW, 600)
    client.refuse_admissions = True
    # WHEN a frame arrives THEN after three writes the table is reported unavailable
    with pytest.raises(StateUnavailableError) as caught:
        store.admit("c1", 10, 4, NOW, 0, "t")
    assert (
        caught.value.message == "the state table refused the frame's admission without saying why"
    )
    assert caught.value.retry_after_s == 1.0
    assert len(client.named("update_item")) == 3
    # AND nothing was counted
    client.refuse_admissions = False
    connection = store.get("c1", NOW)
    assert connection is not None
    assert (connection.counters["frames_in"], connection.counters["frames_refused"]) == (0, 0)


def test_a_write_answering_an_empty_item_is_state_unavailable(
    store: DynamoConnections, client: _Client
) -> None:
    # GIVEN a connection, and a table that answers its writes with an empty item
    store.open("c1", "acme", NOW, 600)
    client.empty_answers = True
    # WHEN a frame is admitted THEN the table is reported unavailable
    with pytest.raises(StateUnavailableError) as caught:
        store.admit("c1", 10, 4, NOW)
    assert caught.value.message == "the state table answered an empty item"
    assert caught.value.retry_after_s == 1.0


def test_finish_returns_the_connection_with_its_id(store: DynamoConnections) -> None:
    store.open("c1", "acme", NOW, 600)
    store.admit("c1", 10, 4, NOW, 0, "a")
    assert store.claim("c1", 0, "me", NOW, NOW + 30)
    after = store.finish("c1", 0, "me", NOW, {"bytes_out": 5})
    assert after is not None
    assert (after.id, after.next_seq, after.in_flight, after.pending) == ("c1", 1, 0, {})


def test_withdraw_gives_back_a_frame_and_counts_it_refused(
    store: DynamoConnections, table: str
) -> None:
    # GIVEN seq 0 and 1 and a frame without seq in flight
    store.open("c1", "acme", NOW, 600)
    for seq, token in ((0, "a"), (1, "b"), (None, "n")):
        assert store.admit("c1", 10, 4, NOW, seq, token) is not None

    def state() -> tuple[int, float, dict[int, str]]:
        connection = store.get("c1", NOW)
        assert connection is not None
        return connection.in_flight, connection.counters["frames_refused"], connection.pending

    # WHEN seq 1 is withdrawn THEN it leaves pending, one fewer in flight, one refused
    store.withdraw("c1", 1)
    assert state() == (2, 1, {0: "a"})
    # AND withdrawing it again changes nothing (it is no longer pending)
    store.withdraw("c1", 1)
    assert state() == (2, 1, {0: "a"})
    # WHEN the frame without seq is withdrawn THEN only the counters change
    store.withdraw("c1", None)
    assert state() == (1, 2, {0: "a"})
    # AND withdrawing from a connection that is gone creates nothing
    store.withdraw("gone", None)
    store.withdraw("gone", 0)
    assert raw_item(table, "wsconn#gone") is None


def test_close_deletes_exactly_the_window_from_next_seq(
    store: DynamoConnections, table: str, client: _Client
) -> None:
    # GIVEN a connection whose seq 0 to 2 were delivered (next_seq 3), answers held at 3
    # and 6 (window 4), and stray answers just outside the window at 2 and 7
    store.open("c1", "acme", NOW, 600)
    for seq in range(3):
        store.admit("c1", 10, 4, NOW, seq, f"t{seq}")
        assert store.claim("c1", seq, "me", NOW, NOW + 30)
        assert store.finish("c1", seq, "me", NOW, {}, held=False) is not None
    for seq in (3, 6):
        store.admit("c1", 10, 4, NOW, seq, f"t{seq}")
        store.hold("c1", seq, b"{}", NOW, 900, {})
    for seq in (2, 7):
        put_raw(table, {"pk": {"S": held_key("c1", seq)}, "answer": {"B": b"{}"}})
    # WHEN it closes
    last = store.close("c1", NOW, 4)
    # THEN its last state comes back, and exactly seq 3 to 6 were deleted, in one batch
    assert last is not None
    assert (last.id, last.next_seq) == ("c1", 3)
    assert deleted_keys(client) == [held_key("c1", s) for s in range(3, 7)]
    assert [raw_item(table, held_key("c1", s)) is None for s in (2, 3, 6, 7)] == [
        False,
        True,
        True,
        False,
    ]


def test_closing_a_gone_connection_deletes_the_window_from_zero(
    store: DynamoConnections, table: str, client: _Client
) -> None:
    # GIVEN an answer held at seq 0 of a connection whose item is gone
    put_raw(table, {"pk": {"S": held_key("c1", 0)}, "answer": {"B": b"{}"}})
    # WHEN it closes THEN nothing comes back and the window from seq 0 is deleted
    assert store.close("c1", NOW, 4) is None
    assert deleted_keys(client) == [held_key("c1", s) for s in range(4)]
    assert raw_item(table, held_key("c1", 0)) is None


def test_close_deletes_a_wide_window_in_batches_of_25(
    store: DynamoConnections, table: str, client: _Client
) -> None:
    # GIVEN answers held at the first and last seq of a window of 64
    store.open("c1", "acme", NOW, 600)
    for seq in (0, 63):
        put_raw(table, {"pk": {"S": held_key("c1", seq)}, "answer": {"B": b"{}"}})
    # WHEN it closes
    store.close("c1", NOW, 64)
    # THEN both are deleted, each key sent once, in batches of 25, 25 and 14
    assert raw_item(table, held_key("c1", 0)) is None
    assert raw_item(table, held_key("c1", 63)) is None
    assert deleted_keys(client) == [held_key("c1", s) for s in range(64)]
    sizes = [len(call["RequestItems"][table]) for call in client.named("batch_write_item")]
    assert sizes == [25, 25, 14]


def test_close_sends_unprocessed_deletes_again(
    store: DynamoConnections, table: str, client: _Client
) -> None:
    # GIVEN answers held at seq 0 to 3, and a table that twice processes only one delete
    # of a batch (throttling)
    store.open("c1", "acme", NOW, 600)
    for seq in range(4):
        put_raw(table, {"pk": {"S": held_key("c1", seq)}, "answer": {"B": b"{}"}})
    client.unprocessed = 2
    # WHEN it closes THEN what was left unprocessed is sent again until all are deleted
    store.close("c1", NOW, 4)
    assert [raw_item(table, held_key("c1", s)) for s in range(4)] == [None] * 4
    sizes = [len(call["RequestItems"][table]) for call in client.named("batch_write_item")]
    assert sizes == [4, 3, 2]


def test_close_gives_up_on_a_batch_after_five_tries(
    store: DynamoConnections, table: str, client: _Client
) -> None:
    # GIVEN an answer held at seq 0, and a table that processes no delete at all
    store.open("c1", "acme", NOW, 600)
    put_raw(table, {"pk": {"S": held_key("c1", 0)}, "answer": {"B": b"{}"}})
    client.unprocessed = -1
    # WHEN it closes THEN the batch is sent five times, then left (it expires by itself)
    last = store.close("c1", NOW, 4)
    assert last is not None
    assert len(client.named("batch_write_item")) == 5
    assert raw_item(table, held_key("c1", 0)) is not None


def test_an_unreachable_table_names_itself(aws_env: str) -> None:
    store = DynamoConnections(DynamoStateStore("no-such-table", _real))
    with pytest.raises(StateUnavailableError) as caught:
        store.get("c1", NOW)
    assert "no-such-table" in caught.value.message
    assert caught.value.retry_after_s == 1.0
