"""The circuit breaker's states with an injected clock, and the retry budget."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from spillway.policy.health import CircuitBreaker, RetryBudget


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


# --- readiness probes of a circuit opened by refused connections -----------------------


class Probe:
    """A readiness probe whose answer the test sets; it counts its calls."""

    def __init__(self) -> None:
        self.ready = False
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.ready


class Deferred:
    """Runs probes only when told to (a probe in flight until then)."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def __call__(self, job: Callable[[], None]) -> None:
        self.pending.append(job)

    def finish(self) -> None:
        jobs, self.pending = self.pending, []
        for job in jobs:
            job()


def probing(
    clock: Clock, probe: Probe, run: Callable[[Callable[[], None]], None] | None = None
) -> CircuitBreaker:
    return CircuitBreaker(
        "gpu", failures=5, reset_s=30.0, max_reset_s=120.0, clock=clock,
        probe=probe, probe_interval_s=1.0, run=run or (lambda job: job()),
    )  # fmt: skip


def refuse(b: CircuitBreaker, times: int = 5) -> None:
    for _ in range(times):
        b.failure(refused=True)


def test_a_refusal_opened_circuit_half_opens_once_a_probe_finds_the_backend_ready(
    clock: Clock,
) -> None:
    # GIVEN a circuit opened by refused connections (a GPU service still starting)
    probe = Probe()
    b = probing(clock, probe)
    refuse(b)
    assert state(b) == "open"
    # WHEN requests keep coming while the backend is not ready
    refused = 0
    for _ in range(10):
        refused += not b.allow()
        clock.advance(0.25)
    # THEN they are refused and the backend is probed at most once a second
    assert refused == 10
    assert probe.calls == 3  # at 0 s, 1 s and 2 s
    # WHEN the backend becomes ready
    probe.ready = True
    clock.advance(1.0)
    # THEN the next request is refused but starts the probe that half-opens the circuit,
    # the one after is the trial, and its success closes the circuit (long before 30 s)
    assert not b.allow()
    assert state(b) == "half_open"
    assert b.allow()
    b.success()
    assert state(b) == "closed"
    assert probe.calls == 4


def test_probes_are_single_flight(clock: Clock) -> None:
    probe, run = Probe(), Deferred()
    b = probing(clock, probe, run)
    refuse(b)
    # WHEN many requests arrive over 5 s while one probe is still in flight
    for _ in range(50):
        assert not b.allow()
        clock.advance(0.1)
    # THEN only that one probe was started
    assert len(run.pending) == 1
    probe.ready = True
    run.finish()
    assert state(b) == "half_open"


def test_a_circuit_opened_by_timeouts_is_not_probed(clock: Clock) -> None:
    # GIVEN a circuit opened by a frozen backend (timeouts, not refusals)
    probe = Probe()
    probe.ready = True
    b = probing(clock, probe)
    for _ in range(5):
        b.failure()
    # THEN it waits its reset time as before, without probing
    for _ in range(20):
        assert not b.allow()
        clock.advance(1.0)
    assert probe.calls == 0
    clock.advance(10.0)
    assert state(b) == "half_open"


def test_a_failing_probe_counts_as_not_ready(clock: Clock) -> None:
    def broken() -> bool:
        raise OSError("connection refused")

    b = CircuitBreaker(
        "gpu", failures=1, reset_s=30.0, max_reset_s=60.0, clock=clock, probe=broken,
        run=lambda job: job(),
    )  # fmt: skip
    b.failure(refused=True)
    assert not b.allow()
    assert state(b) == "open"
