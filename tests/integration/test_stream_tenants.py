"""Each tenant's share of the WebSocket API on DynamoDB (a moto server on 127.0.0.1): its
connections capped at ``$connect`` and counted out at ``$disconnect`` (or once a missed
``$disconnect``'s connection is gone or lapsed), its frames in flight and its frame rate,
another tenant's budget untouched; a frame taken back from its connection."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from spillway.state.table import DynamoStateStore, create_table
from spillway.streams.dynamo_connections import DynamoConnections
from spillway.streams.tenants import (
    CONNECTION_LIFE_S,
    IN_FLIGHT,
    RATE,
    SLOT_STALE_S,
    DynamoTenantBudgets,
)

NOW = 1_800_000_000.0
UNLIMITED = 10_000.0


def _client() -> Any:
    import boto3

    return boto3.client("dynamodb")


@pytest.fixture
def state(aws_env: str) -> Iterator[DynamoStateStore]:
    name = f"state-{uuid.uuid4().hex[:8]}"
    create_table(_client(), name)
    yield DynamoStateStore(name, _client)
    _client().delete_table(TableName=name)


@pytest.fixture
def budgets(state: DynamoStateStore) -> DynamoTenantBudgets:
    # admissions take no time: each is judged at the time the test gives it
    return DynamoTenantBudgets(state, elapsed=lambda: 0.0)


def test_a_tenant_at_its_connection_cap_is_refused_while_another_connects(
    state: DynamoStateStore, budgets: DynamoTenantBudgets
) -> None:
    connections = DynamoConnections(state)
    # GIVEN acme holding its cap of 3 open connections
    for name in ("a1", "a2", "a3"):
        assert budgets.connect("acme", name, NOW, 3)
        connections.open(name, "acme", NOW, 600)
    # WHEN acme opens a fourth and globex its first
    fourth = budgets.connect("acme", "a4", NOW, 3)
    globex = budgets.connect("globex", "g1", NOW, 3)
    # THEN acme's is refused and globex's counted in
    assert (fourth, globex) == (False, True)
    # AND the same connection counted again (a retried write) takes no second place
    assert budgets.connect("acme", "a3", NOW, 3)
    # AND once one of acme's closes, acme connects again, up to the cap only
    budgets.disconnect("acme", "a1")
    assert budgets.connect("acme", "a4", NOW, 3)
    connections.open("a4", "acme", NOW, 600)
    assert not budgets.connect("acme", "a5", NOW, 3)


def test_a_missed_disconnect_frees_its_place_once_its_connection_is_gone_or_lapsed(
    state: DynamoStateStore, budgets: DynamoTenantBudgets
) -> None:
    connections = DynamoConnections(state)
    # GIVEN acme at its cap of 2: a1 live; a2 counted, but its item closed without a
    # $disconnect reaching the budget (a push met 410 Gone, or it never got written)
    for name in ("a1", "a2"):
        assert budgets.connect("acme", name, NOW, 2)
    connections.open("a1", "acme", NOW, 100_000)
    # WHEN acme connects again THEN a2's place is taken back, and a third is refused
    assert budgets.connect("acme", "a3", NOW, 2)
    connections.open("a3", "acme", NOW, 100_000)
    assert not budgets.connect("acme", "a4", NOW, 2)
    # AND past API Gateway's 2 h connection life, live items or not, the places lapse
    later = NOW + CONNECTION_LIFE_S
    for name in ("a4", "a5"):
        assert budgets.connect("acme", name, later, 2)
        connections.open(name, "acme", later, 100_000)
    assert not budgets.connect("acme", "a6", later, 2)


def test_frames_in_flight_are_bounded_per_tenant(budgets: DynamoTenantBudgets) -> None:
    # GIVEN a bound of 2 frames in flight a tenant
    # WHEN acme sends three frames and globex one
    acme = [budgets.admit("acme", f"t{i}", NOW, 2, UNLIMITED, 100) for i in range(3)]
    globex = budgets.admit("globex", "g0", NOW, 2, UNLIMITED, 100)
    # THEN acme's third is refused with 2 in flight, globex's admitted
    assert [(a.refusal, a.in_flight) for a in acme] == [(None, 1), (None, 2), (IN_FLIGHT, 2)]
    assert (globex.refusal, globex.in_flight) == (None, 1)
    # AND once acme's first is released a frame is admitted again
    budgets.release("acme", "t0")
    assert budgets.admit("acme", "t3", NOW, 2, UNLIMITED, 100).refusal is None
    assert budgets.admit("acme", "t4", NOW, 2, UNLIMITED, 100).refusal == IN_FLIGHT
    # AND slots left by invocations that died are taken back once stale
    stale = NOW + SLOT_STALE_S
    assert budgets.admit("acme", "t5", stale, 2, UNLIMITED, 100).in_flight == 1


def test_frames_over_a_tenants_rate_are_refused_until_it_refills(
    budgets: DynamoTenantBudgets,
) -> None:
    # GIVEN 10 frames/s with bursts of 3
    def admit(tenant: str, token: str, at: float) -> tuple[str | None, float]:
        admission = budgets.admit(tenant, token, at, 1000, 10.0, 3)
        return admission.refusal, round(admission.retry_after_s, 3)

    # WHEN acme sends 4 frames at once and globex 1
    burst = [admit("acme", f"t{i}", NOW) for i in range(4)]
    # THEN the fourth is over acme's rate, told to wait 0.1 s; globex's is admitted
    assert burst == [(None, 0.0), (None, 0.0), (None, 0.0), (RATE, 0.1)]
    assert admit("globex", "g0", NOW) == (None, 0.0)
    # AND 0.1 s later one more fits, not two
    assert admit("acme", "t4", NOW + 0.1) == (None, 0.0)
    assert admit("acme", "t5", NOW + 0.1)[0] == RATE
    # AND after a quiet second the whole burst is there again
    assert [admit("acme", f"u{i}", NOW + 2)[0] for i in range(4)] == [None, None, None, RATE]


def test_a_frame_whose_write_waited_is_judged_at_the_time_it_was_written(
    state: DynamoStateStore,
) -> None:
    # GIVEN 200 frames/s with bursts of 400, and a frame admitted at NOW + 2.1
    ticks = iter([0.0, 0.0, 10.0, 12.1, 12.1, 12.1, 12.1])
    budgets = DynamoTenantBudgets(state, elapsed=lambda: next(ticks))
    assert budgets.admit("acme", "a", NOW + 2.1, 128, 200.0, 400).refusal is None
    # WHEN a frame whose clock was read at NOW is written 2.1 s later (it waited on the
    # table while the other frame went in)
    late = budgets.admit("acme", "b", NOW, 128, 200.0, 400)
    # THEN it is admitted: two frames are far under the rate (it was refused tenant_rate)
    assert (late.refusal, late.in_flight) == (None, 2)


def test_a_withdrawn_frame_leaves_its_seq_open_and_counts_refused(
    state: DynamoStateStore,
) -> None:
    connections = DynamoConnections(state)
    connections.open("c1", "acme", NOW, 600)
    # GIVEN seq 0 admitted on a connection
    first = connections.admit("c1", 10, 4, NOW, 0, "tok")
    assert first is not None
    assert first.admitted
    # WHEN its tenant's budget refuses it and it is withdrawn
    connections.withdraw("c1", 0)
    # THEN seq 0 may be sent again, and the counters say one refused, none in flight
    again = connections.admit("c1", 10, 4, NOW, 0, "tok2")
    assert again is not None
    assert again.admitted
    connection = connections.get("c1", NOW)
    assert connection is not None
    assert (connection.in_flight, connection.counters["frames_refused"]) == (1, 1)
    assert connection.pending == {0: "tok2"}
