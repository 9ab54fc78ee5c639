"""What the mutation run of spillway/async_inference/states.py found untested
(docs/mutation.md): the 3xx edge of success, the claim's time stamp, and no redelivery
delay for a lease that has ended or a request that is not running."""

from __future__ import annotations

import pytest

from spillway.async_inference.records import AsyncRecord, request_id
from spillway.async_inference.states import Lifecycle, final_state
from spillway.state.table import scope

T0 = 1_800_000_000.0
RULES = Lifecycle(lease_s=60, max_attempts=3)


def queued(now: float) -> AsyncRecord:
    return AsyncRecord(
        id=request_id("alice", None),
        tenant="alice",
        scope=scope("alice"),
        model="sum",
        state="queued",
        created_at=now,
        updated_at=now,
        expires_at=int(now + 86_400),
        input="s3://bucket/async/in",
        output="s3://bucket/async/out/",
    )


@pytest.mark.parametrize(
    ("status", "state"), [(200, "succeeded"), (299, "succeeded"), (300, "failed")]
)
def test_only_2xx_records_success(status: int, state: str) -> None:
    assert final_state(status) == state


@pytest.mark.parametrize(
    ("status", "outcome"), [(299, "succeeded"), (300, "failed"), (301, "failed")]
)
def test_a_3xx_answer_is_a_final_failure_not_a_success(status: int, outcome: str) -> None:
    assert RULES.outcome(status, receive_count=1) == outcome


def test_a_claim_stamps_the_time_it_was_made() -> None:
    # GIVEN a request queued 5 s ago
    record = queued(T0)
    # WHEN it is claimed now
    claimed = RULES.claimed(record, "gpu-1/t1", T0 + 5)
    # THEN its record was last touched now, not when it was queued
    assert claimed.updated_at == T0 + 5
    assert claimed.model_dump()["updated_at"] == T0 + 5


def test_no_redelivery_delay_once_the_lease_has_ended() -> None:
    # GIVEN a running request whose lease ended a second ago (and one ending now)
    running = RULES.claimed(queued(T0), "gpu-1/t1", T0)
    # THEN a lost claim leaves the delivery as it is
    assert RULES.redelivery_in(running, T0 + 61) is None
    assert RULES.redelivery_in(running, T0 + 60.5) == 1
    assert RULES.redelivery_in(running, T0 + 30) == 31


def test_no_redelivery_delay_for_a_request_that_is_not_running() -> None:
    # GIVEN a queued request that still carries a lease in the future
    record = queued(T0).model_copy(update={"lease_until": T0 + 60})
    # THEN its delivery is left as it is
    assert RULES.redelivery_in(record, T0) is None
