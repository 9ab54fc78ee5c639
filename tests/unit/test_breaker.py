"""The circuit breaker's states with an injected clock, and the retry budget."""

from __future__ import annotations

import pytest

from functions.router.health import CircuitBreaker, RetryBudget


class Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


def state(b: CircuitBreaker) -> str:
    """The breaker's state (a plain string, so each check stands alone)."""
    return b.state


def breaker(clock: Clock, **kwargs: float) -> CircuitBreaker:
    options = {"failures": 5, "reset_s": 5.0, "max_reset_s": 40.0, **kwargs}
    return CircuitBreaker("gpu", clock=clock, **options)  # type: ignore[arg-type]


def test_opens_after_five_consecutive_failures(clock: Clock) -> None:
    # GIVEN a closed breaker
    b = breaker(clock)
    # WHEN four failures happen, the circuit stays closed
    for _ in range(4):
        assert b.allow()
        b.failure()
    assert state(b) == "closed"
    # THEN the fifth opens it and requests are refused
    assert b.allow()
    b.failure()
    assert state(b) == "open"
    assert not b.allow()
    assert b.retry_after_s() == 5.0


def test_a_success_resets_the_failure_count(clock: Clock) -> None:
    b = breaker(clock)
    for _ in range(4):
        b.failure()
    b.success()
    for _ in range(4):
        b.failure()
    assert state(b) == "closed"


def test_half_open_lets_exactly_one_trial_through(clock: Clock) -> None:
    b = breaker(clock)
    for _ in range(5):
        b.failure()
    clock.advance(4.999)
    assert not b.allow()
    clock.advance(0.001)
    # THEN after the wait one request is the trial and the others are still refused
    assert state(b) == "half_open"
    assert b.allow()
    assert not b.allow()
    assert not b.allow()


def test_a_successful_trial_closes_the_circuit(clock: Clock) -> None:
    b = breaker(clock)
    for _ in range(5):
        b.failure()
    clock.advance(5)
    assert b.allow()
    b.success()
    assert state(b) == "closed"
    assert all(b.allow() for _ in range(10))


def test_each_reopen_doubles_the_wait_up_to_the_cap(clock: Clock) -> None:
    b = breaker(clock)
    for _ in range(5):
        b.failure()
    waits = []
    for _ in range(5):
        waits.append(b.retry_after_s())
        clock.advance(b.retry_after_s())
        assert b.allow()
        b.failure()  # the trial fails: open again, longer
    assert waits == [5.0, 10.0, 20.0, 40.0, 40.0]
    assert b.opened_count == 6
    # AND a success afterwards brings the wait back to the base
    clock.advance(b.retry_after_s())
    assert b.allow()
    b.success()
    for _ in range(5):
        b.failure()
    assert b.retry_after_s() == 5.0


def test_a_neutral_trial_leaves_the_circuit_half_open_for_the_next_one(clock: Clock) -> None:
    b = breaker(clock)
    for _ in range(5):
        b.failure()
    clock.advance(5)
    assert b.allow()
    b.neutral()
    assert state(b) == "half_open"
    assert b.allow()


def test_late_failures_while_open_do_not_extend_the_wait(clock: Clock) -> None:
    b = breaker(clock)
    for _ in range(5):
        b.failure()
    clock.advance(3)
    b.failure()  # a request allowed before the circuit opened reports late
    assert b.retry_after_s() == 2.0


def test_bad_arguments_are_refused(clock: Clock) -> None:
    with pytest.raises(ValueError, match="failures"):
        breaker(clock, failures=0)
    with pytest.raises(ValueError, match="reset_s"):
        breaker(clock, reset_s=10, max_reset_s=5)


def test_retry_budget_allows_at_most_a_tenth_of_requests_plus_one() -> None:
    # GIVEN a 10% budget
    budget = RetryBudget(0.1)
    allowed = 0
    # WHEN 1,000 requests each want a retry
    for _ in range(1000):
        budget.deposit()
        allowed += budget.try_spend()
    # THEN at most 10% of them (plus the initial token) got one
    assert allowed == 101
    assert budget.retries == 101
    assert budget.requests == 1000


def test_retry_budget_does_not_bank_more_than_its_cap() -> None:
    budget = RetryBudget(0.1, cap=10)
    for _ in range(10_000):
        budget.deposit()
    spent = 0
    while budget.try_spend():
        spent += 1
    assert spent == 10
