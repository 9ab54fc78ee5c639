"""The async request's state machine in the process, without a server: claims, leases,
redelivery after a lease ends, settles, retries, the dead-letter path and lost messages,
at the times a test names, with two tenants whose records share the rules and never
each other's claims."""

from __future__ import annotations

import pytest

from spillway.async_inference.queue import Message, fair_order
from spillway.async_inference.records import AsyncRecord, owner_scope, request_id
from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.states import (
    MAX_VISIBILITY_S,
    ORPHAN_AFTER_S,
    Lifecycle,
    final_state,
    is_server_fault,
)
from spillway.state.table import scope

T0 = 1_800_000_000.0
LEASE_S = 60
ATTEMPTS = 3


@pytest.fixture
def rules() -> Lifecycle:
    return Lifecycle(lease_s=LEASE_S, max_attempts=ATTEMPTS)


def queued(tenant: str, now: float) -> AsyncRecord:
    return AsyncRecord(
        id=request_id(tenant, None),
        tenant=tenant,
        scope=scope(tenant),
        model="sum",
        state="queued",
        created_at=now,
        updated_at=now,
        expires_at=int(now + 86_400),
        input="s3://bucket/async/in",
        output="s3://bucket/async/out/",
    )


def test_the_rules_follow_the_settings() -> None:
    settings = AsyncSettings(lease_s=90, max_attempts=5)

    rules = Lifecycle.of(settings)

    assert (rules.lease_s, rules.max_attempts) == (90, 5)
    assert rules.orphan_after_s == ORPHAN_AFTER_S  # never shorter than the drain's lag
    assert Lifecycle(lease_s=600, max_attempts=1).orphan_after_s == 600.0


def test_a_queued_request_is_claimed_under_a_lease(rules: Lifecycle) -> None:
    now = T0
    # GIVEN a queued request
    record = queued("alice", now)
    assert rules.is_claimable(record, now)

    # WHEN a consumer claims it
    claimed = rules.claimed(record, "gpu-1/t1", now)

    # THEN it runs under that consumer's lease, one attempt used
    assert claimed.state == "running"
    assert claimed.owner == "gpu-1/t1"
    assert claimed.lease_until == now + LEASE_S
    assert claimed.attempts == 1
    assert claimed.updated_at == now
    assert rules.is_held(claimed, now)


def test_a_live_lease_turns_a_redelivery_away_until_it_ends(rules: Lifecycle) -> None:
    now = T0
    # GIVEN a request claimed 20 s ago
    claimed = rules.claimed(queued("alice", now), "gpu-1/t1", now)
    now += 20

    # WHEN its message is delivered again
    # THEN it cannot be claimed, and the delivery comes back once the lease has ended
    assert not rules.is_claimable(claimed, now)
    assert rules.redelivery_in(claimed, now) == LEASE_S - 20 + 1


def test_a_redelivery_after_the_lease_ended_takes_the_request_over(rules: Lifecycle) -> None:
    now = T0
    # GIVEN a request whose consumer stopped answering
    first = rules.claimed(queued("alice", now), "gpu-1/t1", now)

    # WHEN its lease has ended and the queue delivers it again
    now += LEASE_S + 1
    assert not rules.is_held(first, now)
    assert rules.is_claimable(first, now)
    second = rules.claimed(first, "cpu-1/t2", now)

    # THEN the new claim holds it, counts a second attempt, and the old one may no
    # longer settle it
    assert (second.owner, second.attempts) == ("cpu-1/t2", 2)
    assert rules.may_settle(second, "cpu-1/t2")
    assert not rules.may_settle(second, "gpu-1/t1")


def test_the_lease_is_held_up_to_its_last_second(rules: Lifecycle) -> None:
    now = T0
    claimed = rules.claimed(queued("alice", now), "gpu-1/t1", now)

    now += LEASE_S

    assert rules.is_held(claimed, now)
    assert not rules.is_claimable(claimed, now)
    assert rules.redelivery_in(claimed, now) == 1


def test_a_very_long_lease_is_waited_for_at_most_as_long_as_sqs_allows() -> None:
    now = T0
    rules = Lifecycle(lease_s=100_000, max_attempts=ATTEMPTS)
    claimed = rules.claimed(queued("alice", now), "gpu-1/t1", now)

    assert rules.redelivery_in(claimed, now) == MAX_VISIBILITY_S


def test_a_lost_claim_on_a_record_that_is_not_running_leaves_the_delivery_alone(
    rules: Lifecycle,
) -> None:
    now = T0
    # The claim lost because the record moved on (settled, released) after it was read.
    record = queued("alice", now)

    assert rules.redelivery_in(record, now) is None


@pytest.mark.parametrize("state", ["succeeded", "failed"])
def test_a_settled_request_is_never_claimed_again(rules: Lifecycle, state: str) -> None:
    now = T0
    record = queued("alice", now).model_copy(update={"state": state})

    assert rules.is_settled(record)
    assert not rules.is_claimable(record, now)


def test_an_unknown_or_expired_request_has_nothing_to_run(rules: Lifecycle) -> None:
    now = T0
    assert rules.is_settled(None)
    assert not rules.is_claimable(None, now)


@pytest.mark.parametrize(
    ("status", "delivery", "outcome"),
    [
        (200, 1, "succeeded"),
        (200, ATTEMPTS, "succeeded"),
        (400, 1, "failed"),  # the client's error fails at once
        (404, ATTEMPTS, "failed"),
        (500, 1, "retry"),
        (503, ATTEMPTS - 1, "retry"),
        (429, 1, "retry"),  # overload is the server's
        (500, ATTEMPTS, "dead_letter"),  # the last delivery of a server fault
        (429, ATTEMPTS + 1, "dead_letter"),
    ],
)
def test_a_settle_ends_retries_or_dead_letters_a_run(
    rules: Lifecycle, status: int, delivery: int, outcome: str
) -> None:
    assert rules.outcome(status, delivery) == outcome


def test_final_states_and_faults_follow_the_status() -> None:
    assert [final_state(s) for s in (200, 204, 400, 500)] == [
        "succeeded",
        "succeeded",
        "failed",
        "failed",
    ]
    assert [is_server_fault(s) for s in (400, 404, 429, 500, 504)] == [
        False,
        False,
        True,
        True,
        True,
    ]


def test_a_released_delivery_backs_off_doubling_up_to_a_lease(rules: Lifecycle) -> None:
    assert [rules.retry_in(n) for n in (1, 2, 3, 5, 6, 10)] == [2, 4, 8, 32, 60, 60]


def test_a_settle_by_the_owner_of_the_claim_only(rules: Lifecycle) -> None:
    now = T0
    record = queued("alice", now)
    claimed = rules.claimed(record, "gpu-1/t1", now)

    assert not rules.may_settle(record, None)  # never claimed
    assert rules.may_settle(claimed, "gpu-1/t1")
    assert not rules.may_settle(claimed.model_copy(update={"state": "succeeded"}), "gpu-1/t1")


def test_a_record_whose_deliveries_are_used_up_is_lost_once_its_lease_ends(
    rules: Lifecycle,
) -> None:
    now = T0
    # GIVEN a request on its last delivery, whose consumer crashed
    record = queued("alice", now).model_copy(update={"attempts": ATTEMPTS - 1})
    last = rules.claimed(record, "gpu-1/t3", now)
    assert last.attempts == ATTEMPTS

    # WHEN the drain check looks while the lease is live, and after it ended
    held = rules.is_lost(last, now, queue_empty=False)
    now += LEASE_S + 1
    ended = rules.is_lost(last, now, queue_empty=False)

    # THEN only the record no lease holds any more is taken as lost
    assert (held, ended) == (False, True)


def test_a_record_untouched_with_an_empty_queue_is_lost_only_after_the_orphan_age(
    rules: Lifecycle,
) -> None:
    now = T0
    record = queued("alice", now)

    now += ORPHAN_AFTER_S
    young = rules.is_lost(record, now, queue_empty=True)
    now += 1
    old_but_queued = rules.is_lost(record, now, queue_empty=False)
    old = rules.is_lost(record, now, queue_empty=True)

    assert (young, old_but_queued, old) == (False, False, True)


def test_a_settled_record_is_never_lost(rules: Lifecycle) -> None:
    now = T0
    done = queued("alice", now).model_copy(update={"state": "failed", "attempts": ATTEMPTS})
    now += ORPHAN_AFTER_S * 10

    assert not rules.is_lost(done, now, queue_empty=True)


def test_two_tenants_claims_and_leases_are_their_own(rules: Lifecycle) -> None:
    now = T0
    # GIVEN alice's request claimed by a consumer and bob's still queued
    alice = rules.claimed(queued("alice", now), "gpu-1/a", now)
    bob = queued("bob", now)

    # WHEN bob's delivery arrives while alice's lease is live
    now += 10

    # THEN bob's request is claimable and alice's is not; each record says whose it is
    assert rules.is_claimable(bob, now)
    assert not rules.is_claimable(alice, now)
    bob_claimed = rules.claimed(bob, "gpu-1/b", now)
    assert owner_scope(alice) == scope("alice")
    assert owner_scope(bob_claimed) == scope("bob") != owner_scope(alice)

    # AND when alice's lease ends, a takeover of hers leaves bob's claim as it was
    now += LEASE_S
    taken = rules.claimed(alice, "cpu-1/a2", now)
    assert (taken.tenant, taken.attempts) == ("alice", 2)
    assert rules.is_held(bob_claimed, now - 1)
    assert rules.may_settle(bob_claimed, "gpu-1/b")


def test_a_record_written_before_scopes_belongs_to_its_tenant() -> None:
    now = T0
    legacy = queued("alice", now).model_copy(update={"scope": None})
    anonymous = queued("anonymous", now).model_copy(update={"scope": None})

    assert owner_scope(legacy) == scope("alice")
    assert owner_scope(anonymous) == scope(None)


def test_one_tenants_burst_waits_behind_the_others_single_request() -> None:
    # GIVEN three deliveries of alice's burst ahead of one of bob's, alice running one
    alice, bob = scope("alice"), scope("bob")
    burst = [Message(f"a{i}", f"r{i}", 1, alice) for i in range(3)]
    single = Message("b0", "rb", 1, bob)

    # WHEN the consumer orders them
    order = fair_order([*burst, single], {alice: 1})

    # THEN bob's goes first, then alice's in arrival order
    assert [m.id for m in order] == ["b0", "a0", "a1", "a2"]
