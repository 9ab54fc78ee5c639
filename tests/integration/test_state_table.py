"""The shared state table on DynamoDB (a moto server): its TTL attribute, and one
contract that the DynamoDB store and the unit tier's in-memory store both keep."""

from __future__ import annotations

import random
from collections.abc import Iterator

import boto3
import pytest

from spillway.canary.records import CanaryStore
from spillway.protocol.errors import StateUnavailableError
from spillway.state.table import (
    TTL_ATTRIBUTE,
    DynamoStateStore,
    StateStore,
    create_table,
)
from tests.memory_store import MemoryStateStore

NOW = 1_800_000_000.0


@pytest.fixture
def table(aws_env: str) -> str:
    name = f"router-state-{random.randrange(10**9)}"
    create_table(boto3.client("dynamodb"), name)
    return name


@pytest.fixture(params=["dynamodb", "memory"])
def store(request: pytest.FixtureRequest) -> Iterator[StateStore]:
    if request.param == "memory":
        yield MemoryStateStore()
    else:
        name = request.getfixturevalue("table")
        yield DynamoStateStore(name, lambda: boto3.client("dynamodb"))


def test_the_table_expires_items_by_its_ttl_attribute(table: str) -> None:
    described = boto3.client("dynamodb").describe_time_to_live(TableName=table)
    assert described["TimeToLiveDescription"] == {
        "TimeToLiveStatus": "ENABLED",
        "AttributeName": TTL_ATTRIBUTE,
    }


def test_create_and_replace_are_conditional(store: StateStore) -> None:
    assert store.create("k", {"v": 1}, NOW, None)
    assert not store.create("k", {"v": 2}, NOW, None)
    item = store.get("k", NOW)
    assert item is not None
    assert (item.doc, item.revision, item.expires_at) == ({"v": 1}, 1, None)
    assert store.replace("k", {"v": 3}, 1, None)
    assert not store.replace("k", {"v": 4}, 1, None)  # a writer at a stale revision loses
    item = store.get("k", NOW)
    assert item is not None
    assert (item.doc, item.revision) == ({"v": 3}, 2)


def test_an_expired_item_is_absent_before_the_table_deletes_it(store: StateStore) -> None:
    store.put("s", {"n": 1}, NOW + 10.2)
    item = store.get("s", NOW)
    assert item is not None
    assert item.expires_at == NOW + 11  # whole seconds, rounded up
    assert store.get("s", NOW + 10.9) is not None
    assert store.get("s", NOW + 11) is None
    assert store.touch("s", NOW + 11, NOW + 100) is None
    assert not store.delete("s", NOW + 11)
    # An expired item may be created anew
    assert store.create("s", {"n": 2}, NOW + 11, NOW + 50)
    item = store.get("s", NOW + 12)
    assert item is not None
    assert item.doc == {"n": 2}


def test_touch_renews_and_delete_removes(store: StateStore) -> None:
    store.put("s", {"n": 1}, NOW + 10)
    touched = store.touch("s", NOW + 5, NOW + 905)
    assert touched is not None
    assert (touched.doc, touched.expires_at) == ({"n": 1}, NOW + 905)
    assert store.get("s", NOW + 900) is not None
    assert store.delete("s", NOW + 900)
    assert store.get("s", NOW + 900) is None
    assert not store.delete("s", NOW + 900)


def test_two_stores_record_one_rollback(store: StateStore) -> None:
    first, second = CanaryStore(store, lambda: NOW), CanaryStore(store, lambda: NOW + 1)
    first.start("digits", 2, 10, stable=1)
    assert first.rollback("digits", 2, "a") is not None
    assert second.rollback("digits", 2, "b") is None
    state = second.load("digits")
    assert state is not None
    assert [e.event for e in state.history] == ["started", "rolled_back"]


def test_an_unreachable_table_is_unavailable_not_a_crash(aws_env: str) -> None:
    store = DynamoStateStore("no-such-table", lambda: boto3.client("dynamodb"))
    with pytest.raises(StateUnavailableError, match="no-such-table") as caught:
        store.get("k", NOW)
    assert caught.value.status == 503


def test_concurrent_charges_of_one_tenant_never_pass_its_quota(store: StateStore) -> None:
    # GIVEN a ledger allowing 10 items per tenant, and 6 writers charging 5 items each
    from concurrent.futures import ThreadPoolExecutor

    from spillway.protocol.errors import OverloadedError, QuotaExceededError
    from spillway.state.quotas import QuotaLedger, QuotaLimits

    ledger = QuotaLedger(store, "things", QuotaLimits(count=10, bytes=10**6), "things")

    def charge(n: int) -> str:
        try:
            ledger.charge("alice", f"t-{n}", 100, NOW, NOW + 60, lambda _n, _at: None)
        except QuotaExceededError:
            return "quota"
        except OverloadedError:
            return "contended"
        return "held"

    # WHEN they charge at once
    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(charge, range(30)))
    # THEN what was accepted is exactly what the ledger holds, never more than the quota
    item = store.get(ledger.key("alice"), NOW)
    assert item is not None
    held = set(item.doc["entries"])
    assert held == {f"t-{n}" for n, outcome in enumerate(outcomes) if outcome == "held"}
    assert 1 <= len(held) <= 10
    # AND charging one at a time then fills it to exactly 10, and the 11th is refused
    more = [charge(n) for n in range(30, 30 + 11 - len(held))]
    assert more == ["held"] * (10 - len(held)) + ["quota"]
    # AND another tenant's ledger is untouched by all of it
    ledger.charge("bob", "t-0", 100, NOW, NOW + 60, lambda _n, _at: None)
    bobs = store.get(ledger.key("bob"), NOW)
    assert bobs is not None
    assert list(bobs.doc["entries"]) == ["t-0"]
