"""The demo's checks: the canary section split at the request that rolled the canary back,
its checks named with their figures and bounds, and its by-design failures kept apart;
the frame-stream section's order, duplicate and label counts."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from spillway_cli.console import Checks
from spillway_cli.demo.canary import (
    AFTER_ROLLBACK,
    SESSIONS,
    CanaryReport,
    after_rollback,
    until_rollback,
    wait_for_every_router,
)
from spillway_cli.demo.client import Record, failed
from spillway_cli.demo.report import apart
from spillway_cli.frame_streams import DoorRun, Scenario, StreamLog


@dataclass
class FakeRouter:
    """The router's canary contract in memory: an unpinned request draws the canary at
    ``percent``; a session keeps the version of its first request while the record
    serves it; the guard rolls the canary back as it counts its ``rollback_at``-th
    answer, writing the record before it answers; from then on canary sessions move to
    the stable version. The canary fails every fifth request it answers (20 %)."""

    seed: int
    stable: int = 2
    canary: int = 3
    percent: float = 10.0
    rollback_at: int = 50
    breaks_affinity_at: int | None = None
    """A broken router: the request number at which it moves a session while the canary
    still runs."""
    bound: dict[str, int] = field(default_factory=dict)
    canary_answers: int = 0
    rolled_back: bool = False
    sent: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _draw(self) -> int:
        running = not self.rolled_back
        return self.canary if running and self.rng.random() * 100 < self.percent else self.stable

    def send(self, step: int, session: str | None) -> tuple[int, str]:
        self.sent += 1
        if session is None:
            version = self._draw()
        else:
            version = self.bound.get(session) or self._draw()
            if version == self.canary and self.rolled_back:
                version = self.stable
            if self.sent == self.breaks_affinity_at:
                version = self.canary if version == self.stable else self.stable
            self.bound[session] = version
        status = 200
        if version == self.canary:
            self.canary_answers += 1
            status = 500 if self.canary_answers % 5 == 0 else 200
            self.rolled_back = self.rolled_back or self.canary_answers >= self.rollback_at
        return status, str(version)


def run_section(router: FakeRouter) -> CanaryReport:
    report = CanaryReport(router.stable, router.canary, followed_after_s=0.4)
    until_rollback(router.send, lambda: router.rolled_back, report)
    after_rollback(router.send, report)
    report.pinned_after_rollback = 409
    return report


@pytest.mark.parametrize("seed", range(20))
def test_a_canary_session_moved_by_the_rollback_is_not_a_session_that_switched(
    seed: int,
) -> None:
    # GIVEN a router that keeps sessions as the contract says and rolls the canary back
    # (at 20 % here, so that every seed puts sessions on the canary)
    router = FakeRouter(seed, percent=20.0)
    # WHEN the section sends its traffic
    report = run_section(router)
    # THEN the requests are split at the one that rolled the canary back: every session
    # kept one version while it ran, whatever session came next
    assert report.requests_to_rollback is not None
    canary_sessions = [s for s, v in report.session_versions.items() if v == {"3"}]
    assert canary_sessions, "the seed put no session on the canary"
    assert len(report.session_versions) == SESSIONS
    assert all(len(v) == 1 for v in report.session_versions.values())
    # AND after it, every request (the canary's sessions included) is the stable version's
    assert report.after_rollback == {"v2:200": AFTER_ROLLBACK}
    assert [c.describe() for c in report.checks() if not c.passed] == []
    assert report.ok
    # AND the canary's own failures are counted apart, as by design
    assert report.by_design_failures == router.rollback_at // 5
    assert report.stable_failures == 0


def test_a_router_that_moves_a_session_while_the_canary_runs_fails_the_named_check() -> None:
    # GIVEN a broken router that moves one session to the other version mid-canary
    report = run_section(FakeRouter(0, breaks_affinity_at=202))
    said: list[str] = []
    # WHEN the section's checks are recorded
    passed = Checks(said.append).record("7. canary", report.checks())
    # THEN the session check fails with its figure and bound, and nothing else does
    assert passed is False
    assert said == [
        "   CHECK FAILED [7. canary] every session kept one version while the canary ran: "
        "39 of 40 sessions (bound: = 40 of 40 sessions)"
    ]


def test_a_failure_on_the_stable_version_is_an_error_not_a_canary_failure() -> None:
    # GIVEN the stable version failing one request while the canary runs
    router = FakeRouter(1)
    send = router.send

    def failing_once(step: int, session: str | None) -> tuple[int, str]:
        status, version = send(step, session)
        return (503, version) if step == 10 and version == "2" else (status, version)

    report = CanaryReport(2, 3, followed_after_s=0.4)
    until_rollback(failing_once, lambda: router.rolled_back, report)
    # THEN it is counted against the check, not among the by-design failures
    failed = [c.describe() for c in report.checks() if not c.passed]
    assert "no request failed on a version other than the canary: 1 failed (bound: = 0 failed)" in (
        failed
    )
    assert report.by_design_failures == router.rollback_at // 5


def test_a_canary_never_rolled_back_and_a_stale_router_are_named() -> None:
    # GIVEN a canary the router never rolls back, and a router that still serves it after
    router = FakeRouter(2, rollback_at=10**9)
    report = run_section(router)
    report.pinned_after_rollback = 200
    failed = [c.describe() for c in report.checks() if not c.passed]
    # THEN the checks say which bound each figure missed
    assert failed[0] == ("the canary was rolled back automatically: none (bound: <= 3000 requests)")
    assert failed[1].startswith("after the rollback every request was answered 200 by v2: ")
    assert failed[1].endswith(f"of {AFTER_ROLLBACK} requests (bound: = 200 of 200 requests)")
    assert failed[2] == (
        "a request pinning the rolled-back v3 was refused: 200 (HTTP status) "
        "(bound: = 409 (HTTP status))"
    )


def test_sessions_wait_out_the_routers_canary_ttl() -> None:
    # GIVEN a record written at t=100 and routers that keep a record 5 s
    now = [102.5]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    # WHEN the section waits for every router
    wait_for_every_router(100.0, 5.0, margin_s=1.0, clock=lambda: now[0], sleep=sleep)
    # THEN it waits until the last one has read the record again, and not twice
    assert slept == [3.5]
    wait_for_every_router(100.0, 5.0, margin_s=1.0, clock=lambda: now[0], sleep=sleep)
    assert slept == [3.5]


def test_the_canarys_failures_by_design_are_reported_apart_from_the_error_totals() -> None:
    # GIVEN a canary section whose faulty version failed 10 requests before its rollback
    report = run_section(FakeRouter(3))
    # WHEN the demo closes its summary
    text = apart(report, 7)
    # THEN it names them as intentional, and counts them in no error total
    assert report.by_design_failures == 10
    assert text.startswith("Intentional failures, apart from the error totals: section 7's ")
    assert "it failed 10 of the section's" in text
    assert "counted in no error total" in text


def test_failed_requests_are_named_by_status() -> None:
    # GIVEN a section's records, two of them failed (one never answered: 599)
    records = [
        Record(0.0, "gpu-killed", status, "gpu", 1.0, 0.0, None)
        for status in (200, 503, 200, 599, 200)
    ]
    # WHEN the demo checks them
    check = failed(records)
    # THEN the figure says how many failed and how, against none
    assert not check.passed
    assert check.describe() == "requests that failed: 2 of 5 (503 x1, 599 x1) (bound: = 0 of 5)"
    assert failed(records[:1]).passed


def _stream(stream: int, arrivals: list[int], wrong_at: int | None = None) -> StreamLog:
    """A stream of 4 frames whose answers arrived for ``arrivals`` (seqs), each right
    (``wrong_at``: that seq's answer is wrong)."""
    log = StreamLog(stream, 4, sent_at=dict.fromkeys(range(4), 0.0))
    for seq in arrivals:
        log.answered(seq, seq != wrong_at, "gpu", None)
    return log


def test_a_stream_counts_late_missing_and_duplicated_answers() -> None:
    # GIVEN answers that arrive 0, 2, 1, 2 on a stream of 4 frames
    log = _stream(0, [0, 2, 1, 2])
    # THEN 1 came late, frame 3 is missing, frame 2 was answered twice
    assert log.order() == (1, 1, 1)
    assert _stream(1, [0, 1, 2, 3]).order() == (0, 0, 0)


def test_the_frame_stream_checks_count_right_labels_duplicates_and_order() -> None:
    # GIVEN two streams of 4 frames: one perfect, one with a wrong label and a late answer
    scenario = Scenario(streams=2, frames=4, window=2)
    good = DoorRun("websocket", scenario, [_stream(0, [0, 1, 2, 3])] * 2, 1.0)
    bad = DoorRun("grpc", scenario, [_stream(0, [0, 1, 2, 3]), _stream(1, [1, 0, 2, 3], 2)], 1.0)
    # WHEN the demo checks them
    # THEN every check of the perfect run passes; the other fails on the label and order
    assert all(check.passed for check in good.checks())
    failures = {c.name: c.figure for c in bad.checks() if not c.passed}
    assert failures == {
        "gRPC streams (GPU service), digits frames: answered right": "7",
        "gRPC streams (GPU service), digits frames: answers out of seq order": "1",
    }
    assert bad.summary()["order_kept"] is False
    assert (bad.summary()["answered"], bad.summary()["wrong_answers"]) == (8, 1)


def test_a_door_s_line_tells_frames_answered_with_an_error_from_unanswered_ones() -> None:
    # GIVEN a stream of 4 frames: 0 and 1 answered, 2 answered deadline_exceeded, 3 never
    log = _stream(0, [0, 1])
    log.failed("deadline_exceeded")
    run = DoorRun("websocket", Scenario(streams=1, frames=4, window=1), [log], 1.0)
    # THEN the line counts one unanswered and names the error
    line = run.line()
    assert "2/4 answered right" in line
    assert "1 frames unanswered; answered with an error: deadline_exceeded x1" in line
