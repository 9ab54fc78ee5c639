"""Canary versions in the router, over an in-memory state table, a fake backend and a
fake clock: the share, session affinity across routers, the automatic rollback."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter, defaultdict
from typing import Any

import pytest

from spillway.canary.records import CanaryState, CanaryStore
from spillway.models.canary_spec import RollbackBounds
from spillway_cli.canary_cli import describe
from tests.memory_store import MemoryStateStore
from tests.unit.canary_support import (
    PATH,
    START,
    VERSION,
    Clock,
    VersionedBackend,
    digits_body,
    make_router,
)


def test_a_10_percent_canary_gets_10_percent_of_2000_requests() -> None:
    # GIVEN digits v1 stable and v2 as a 10 % canary
    store, clock = MemoryStateStore(), Clock()
    CanaryStore(store, clock).start("digits", 2, 10, stable=1)
    backend = VersionedBackend(clock)
    router = make_router(store, clock, backend)
    # WHEN 2,000 requests that pin no version arrive
    answers = [router.infer() for _ in range(2000)]
    # THEN the canary served 10 % of them within 3 points, and every answer names its version
    versions = Counter(a.headers[VERSION] for a in answers)
    assert set(versions) == {"1", "2"}
    assert 0.07 <= versions["2"] / 2000 <= 0.13, versions
    assert all(a.status_code == 200 for a in answers)
    # AND the backend was asked for the chosen version by path, never the bare model
    paths = Counter(backend.infer_paths())
    assert set(paths) == {
        "/v2/models/digits/versions/1/infer",
        "/v2/models/digits/versions/2/infer",
    }
    # AND the record was read once per cache period (20 s of traffic, 5 s TTL), not per request
    assert store.calls["get"] <= 8


def test_a_request_that_pins_a_version_keeps_it() -> None:
    store, clock = MemoryStateStore(), Clock()
    CanaryStore(store, clock).start("digits", 2, 100, stable=1)
    backend = VersionedBackend(clock)
    router = make_router(store, clock, backend)
    answer = router.client.post("/v2/models/digits/versions/1/infer", data=b'{"inputs":[]}')
    assert answer.headers[VERSION] == "1"
    assert backend.infer_paths() == ["/v2/models/digits/versions/1/infer"]


def test_sessions_keep_their_first_version_while_the_percent_changes_on_two_routers() -> None:
    # GIVEN two routers over one state table and a canary at 10 %
    store, clock = MemoryStateStore(), Clock()
    canaries = CanaryStore(store, clock)
    canaries.start("digits", 2, 10, stable=1)
    backend = VersionedBackend(clock)
    routers = [make_router(store, clock, backend) for _ in range(2)]
    pick = random.Random(3)
    seen: dict[str, set[str]] = defaultdict(set)
    started_at: dict[str, int] = {}
    # WHEN the percentage moves 10 → 50 → 90 → 0 → 100, each phase brings 100 new sessions,
    # and every session so far sends a request through either router
    for percent in (10, 50, 90, 0, 100):
        canaries.start("digits", 2, percent)
        clock.advance(6)  # past every router's cached record
        started_at.update({f"p{percent}-{i}": percent for i in range(100)})
        sessions = list(started_at)
        pick.shuffle(sessions)
        for session in sessions:
            answer = pick.choice(routers).infer(session)
            assert answer.status_code == 200
            seen[session].add(answer.headers[VERSION])
    # THEN no session ever saw a second version
    assert {s: v for s, v in seen.items() if len(v) != 1} == {}
    # AND each session got the share of the phase it started in
    on_canary = Counter(p for s, p in started_at.items() if seen[s] == {"2"})
    assert on_canary[0] == 0
    assert on_canary[100] == 100
    assert 2 <= on_canary[10] <= 22, on_canary
    assert 35 <= on_canary[50] <= 65, on_canary
    assert on_canary[90] >= 78, on_canary


def test_one_session_id_is_two_sessions_for_two_tenants() -> None:
    store, clock = MemoryStateStore(), Clock()
    CanaryStore(store, clock).start("digits", 2, 50, stable=1)
    router = make_router(store, clock, VersionedBackend(clock), trust_tenant_hints=True)
    for tenant in ("acme", "globex"):
        router.infer("chat-1", headers={"x-spillway-tenant": tenant})
    affinity = [k for k in store.items if k.startswith("affinity#")]
    assert len(affinity) == 2
    assert all(k.endswith("#digits#chat-1") and "acme" not in k for k in affinity)


@pytest.mark.parametrize("session", ["", "a/b", "-lead", "x" * 129, "naïve"])
def test_a_malformed_session_id_is_400(session: str) -> None:
    store, clock = MemoryStateStore(), Clock()
    router = make_router(store, clock, VersionedBackend(clock))
    answer = router.client.post(PATH, data=b"{}", headers={"x-spillway-session": session})
    assert answer.status_code == 400
    assert json.loads(answer.data)["code"] == "invalid_input"


def test_a_canary_failing_20_percent_is_rolled_back_within_its_window() -> None:
    # GIVEN a canary v2 at 10 % that fails 20 % of its requests (v1 never fails), judged
    # over a 60 s window from 50 requests, and two routers over one state table
    store, clock = MemoryStateStore(), Clock()
    canaries = CanaryStore(store, clock)
    bounds = RollbackBounds(window_s=60, min_requests=50)
    canaries.start("digits", 2, 10, stable=1, bounds=bounds)
    backend = VersionedBackend(clock, faults={2: 0.2}, latency={1: 0.02, 2: 0.02})
    routers = [make_router(store, clock, backend) for _ in range(2)]
    first: dict[str, str] = {}
    failures: Counter[str] = Counter()
    late: Counter[str] = Counter()
    # WHEN 100 sessions send 3,000 requests (60 s of traffic) through both routers
    for step in range(3000):
        session = f"user-{step % 100}"
        answer = routers[step % 2].infer(session)
        version = answer.headers[VERSION]
        first.setdefault(session, version)
        if answer.status_code != 200:
            failures[first[session]] += 1
        if step >= 2500:
            late[f"{version}:{answer.status_code}"] += 1
    # THEN the canary was rolled back to 0 %, within the window of its start
    state = canaries.load("digits")
    assert state is not None
    assert state.status == "rolled_back"
    assert state.percent == 0
    rollback = state.history[-1]
    assert rollback.event == "rolled_back"
    assert "fault rate" in rollback.reason
    assert rollback.at - START <= bounds.window_s
    # AND sessions on the stable version never saw a failure; canary sessions did, then
    # moved to the stable version
    assert "1" in first.values()
    assert "2" in first.values()
    assert failures["1"] == 0
    assert failures["2"] > 0
    assert late == Counter({"1:200": 500})
    # AND the rollback was counted once, by the router that decided it
    counted = [line for r in routers for line in r.metric_lines("CanaryRollback")]
    assert len(counted) == 1
    assert counted[0]["model"] == "digits"
    assert counted[0]["version"] == 2
    # AND the status names it
    assert "canary v2 at 0% (rolled back)" in describe(state, "digits")


def test_the_other_router_follows_a_rollback_within_the_cache_period() -> None:
    store, clock = MemoryStateStore(), Clock()
    canaries = CanaryStore(store, clock)
    canaries.start("digits", 2, 100, stable=1)
    routers = [make_router(store, clock, VersionedBackend(clock)) for _ in range(2)]
    assert routers[1].infer().headers[VERSION] == "2"
    canaries.rollback("digits", 2, "operator")
    clock.advance(5.01)
    assert routers[1].infer().headers[VERSION] == "1"


def judged(
    requests: int, percent: float, bounds: RollbackBounds, version: int = 2, **backend: Any
) -> tuple[CanaryState, Counter[int]]:
    """The canary record after ``requests`` unpinned requests to canary ``version`` over
    stable v1, with the backend behaving as ``backend`` says; and the statuses seen."""
    store, clock = MemoryStateStore(), Clock()
    canaries = CanaryStore(store, clock)
    canaries.start("digits", version, percent, stable=1, bounds=bounds)
    router = make_router(store, clock, VersionedBackend(clock, **backend))
    statuses = Counter(router.infer().status_code for _ in range(requests))
    state = canaries.load("digits")
    assert state is not None
    return state, statuses


@pytest.mark.parametrize("status", [400, 404, 429, 504])
def test_answers_that_are_not_the_versions_fault_never_roll_back(status: int) -> None:
    # GIVEN a canary that answers 30 % of its requests with a status the request or the
    # load caused (a 404 here names no version: it is an unknown tensor, say)
    bounds = RollbackBounds(min_requests=20)
    state, statuses = judged(1000, 50, bounds, client_errors={2: 0.3}, client_status=status)
    # THEN the canary still runs after 1,000 requests
    assert statuses[status] > 100
    assert state.status == "running"


def test_a_canary_version_no_backend_serves_is_answered_by_the_stable_version() -> None:
    # GIVEN a canary version no backend has loaded (404 model_not_found for that version)
    # WHEN 200 unpinned requests arrive with the canary at 50 %
    state, statuses = judged(200, 50, RollbackBounds(min_requests=20), version=9, missing={9})
    # THEN no client sees the 404 of a version it did not ask for: the stable version
    # served all 200, and the gap is not the canary's fault (it is not rolled back)
    assert statuses == Counter({200: 200})
    assert state.status == "running"


def test_a_canary_three_times_slower_is_rolled_back_on_p99() -> None:
    bounds = RollbackBounds(min_requests=40)
    state, statuses = judged(600, 30, bounds, latency={1: 0.02, 2: 0.06})
    assert statuses == Counter({200: 600})
    assert state.status == "rolled_back"
    assert state.history[-1].reason.startswith("p99 60.0 ms")


def test_a_healthy_canary_runs_on() -> None:
    # GIVEN a canary as fast and as reliable as the stable version (both fail 0.5 %)
    bounds = RollbackBounds(min_requests=50)
    state, statuses = judged(3000, 50, bounds, faults={1: 0.005, 2: 0.005})
    assert statuses[500] > 0
    assert state.status == "running"


def test_config_json_starts_a_canary_once_per_version() -> None:
    # GIVEN a backend whose digits config names canary v2 at 20 % over stable v1
    store, clock = MemoryStateStore(), Clock()
    spec = {"version": 2, "stable": 1, "percent": 20}
    backend = VersionedBackend(clock, canary=spec)
    router = make_router(store, clock, backend)
    # WHEN the first request arrives
    router.infer()
    # THEN the record holds the config's canary
    canaries = CanaryStore(store, clock)
    state = canaries.load("digits")
    assert state is not None
    assert (state.stable, state.canary, state.percent) == (1, 2, 20)
    assert state.history[-1].reason == "config.json"
    # WHEN an operator rolls it back and the config is read again later
    canaries.rollback("digits", 2, "operator")
    clock.advance(61)
    router.infer()
    # THEN the rollback stands: the config does not restart a version the record knows
    state = canaries.load("digits")
    assert state is not None
    assert state.status == "rolled_back"
    # WHEN the config names a new version
    backend.canary = {"version": 3, "stable": 1, "percent": 5}
    clock.advance(61)
    router.infer()
    state = canaries.load("digits")
    assert state is not None
    assert (state.canary, state.percent, state.status) == (3, 5, "running")


def test_an_unreachable_state_table_leaves_requests_served() -> None:
    # GIVEN a router whose state table is down
    store, clock = MemoryStateStore(), Clock()
    CanaryStore(store, clock).start("digits", 2, 50, stable=1)
    store.down = True
    backend = VersionedBackend(clock)
    router = make_router(store, clock, backend)
    # WHEN requests (with and without sessions) arrive
    answers = [router.infer(), router.infer("s-1")]
    # THEN they are served by the backends' default version, unpinned
    assert [a.status_code for a in answers] == [200, 200]
    assert backend.infer_paths() == ["/v2/models/digits/infer"] * 2


def test_a_promotion_moves_sessions_to_the_new_stable_version() -> None:
    store, clock = MemoryStateStore(), Clock()
    canaries = CanaryStore(store, clock)
    canaries.start("digits", 2, 0, stable=1)
    router = make_router(store, clock, VersionedBackend(clock))
    assert router.infer("s-1").headers[VERSION] == "1"
    canaries.start("digits", 2, 100)
    clock.advance(6)
    assert router.infer("s-1").headers[VERSION] == "1"  # the percentage does not move it
    canaries.promote("digits")
    clock.advance(6)
    assert router.infer("s-1").headers[VERSION] == "2"  # v1 is no longer served


# --- judgement a client cannot steer -----------------------------------------------------

LARGE = digits_body(64)  # about 20 KiB


def steered(**backend: Any) -> tuple[CanaryState, Counter[str]]:
    """The canary record after 60 s of traffic in which one tenant sends large bodies only
    on the sessions the router bound to the canary (a small first request shows it which),
    while another tenant sends small unpinned requests; and what each version served."""
    store, clock = MemoryStateStore(), Clock()
    canaries = CanaryStore(store, clock)
    canaries.start("digits", 2, 50, stable=1, bounds=RollbackBounds(window_s=60))
    router = make_router(store, clock, VersionedBackend(clock, **backend))
    bound: dict[str, str] = {}
    served: Counter[str] = Counter()
    for step in itertools.count():
        if clock.now - START >= 60:
            break
        for _ in range(5):
            answer = router.infer(tenant="victim")
            served[f"{answer.headers[VERSION]}:small"] += 1
        if len(bound) < 40:  # learn which sessions the canary got
            session = f"probe-{len(bound)}"
            bound[session] = router.infer(session, tenant="mallory").headers[VERSION]
        on_canary = [s for s, version in bound.items() if version == "2"]
        if on_canary:
            answer = router.infer(on_canary[step % len(on_canary)], body=LARGE, tenant="mallory")
            served[f"{answer.headers[VERSION]}:large"] += 1
    state = canaries.load("digits")
    assert state is not None
    return state, served


def test_large_bodies_sent_only_to_the_canary_do_not_roll_back_a_canary_like_stable() -> None:
    # GIVEN a canary identical to the stable version: 5 ms plus 20 ms per KiB of body
    # WHEN one tenant sends 20 KiB bodies only on canary-bound sessions for 60 s
    state, served = steered(latency={1: 0.005, 2: 0.005}, per_kib={1: 0.02, 2: 0.02})
    # THEN the canary runs on, having served all the large requests
    last = state.history[-1]
    assert state.status == "running", f"{last.reason} after {last.at - START:.1f} s"
    assert served["2:large"] > 100
    assert served["1:large"] == 0
    assert served["1:small"] > 100


def test_a_canary_slower_per_row_is_rolled_back_under_the_same_traffic() -> None:
    # GIVEN a canary that takes three times as long per KiB as the stable version
    state, _ = steered(latency={1: 0.005, 2: 0.005}, per_kib={1: 0.02, 2: 0.06})
    # THEN it is rolled back on like-sized requests
    assert state.status == "rolled_back"
    assert state.history[-1].reason.startswith("p99")
    assert "like-sized" in state.history[-1].reason


def test_a_faulting_canary_is_rolled_back_under_the_same_traffic() -> None:
    state, _ = steered(latency={1: 0.005, 2: 0.005}, per_kib={1: 0.02, 2: 0.02}, faults={2: 0.1})
    assert state.status == "rolled_back"
    assert state.history[-1].reason.startswith("fault rate")


def test_slow_client_errors_on_the_canary_never_roll_it_back() -> None:
    # GIVEN a canary like the stable version, whose 400s (a quarter of its answers, to
    # requests a client made invalid) take 200 ms each
    bounds = RollbackBounds(min_requests=40)
    state, statuses = judged(2000, 50, bounds, client_errors={2: 0.25}, client_error_latency=0.2)
    # THEN the client's errors say nothing about the version
    last = state.history[-1]
    assert state.status == "running", f"{last.reason} after {last.at - START:.1f} s"
    assert statuses[400] > 200


# --- pinned requests after a rollback ---------------------------------------------------

PINNED = "/v2/models/digits/versions/2/infer"


def test_after_a_rollback_a_request_pinning_the_rolled_back_version_is_refused() -> None:
    # GIVEN a canary v2 that a request may pin while it runs
    store, clock = MemoryStateStore(), Clock()
    canaries = CanaryStore(store, clock)
    canaries.start("digits", 2, 50, stable=1)
    backend = VersionedBackend(clock)
    router = make_router(store, clock, backend)
    assert router.infer(path=PINNED, tenant="acme").headers[VERSION] == "2"
    # WHEN it is rolled back, and a request pins it (in any mode)
    canaries.rollback("digits", 2, "operator")
    clock.advance(5.01)
    answers = [
        router.infer(path=PINNED, tenant="acme"),
        router.infer(path=PINNED, tenant="acme", headers={"x-spillway-mode": "async"}),
        router.infer(path=PINNED, tenant="acme", headers={"x-spillway-mode": "batch"}),
    ]
    # THEN it is refused with a stable code, and v2 is never asked again
    assert [a.status_code for a in answers] == [409] * 3
    assert json.loads(answers[0].data) == {
        "error": "version 2 of digits was rolled back; pin another version or none",
        "code": "version_rolled_back",
    }
    assert backend.infer_paths() == [PINNED]
    # AND the stable version, pinned or not, is served
    assert router.infer(path="/v2/models/digits/versions/1/infer").status_code == 200
    assert router.infer().headers[VERSION] == "1"


def test_the_operator_may_let_pinned_requests_reach_a_rolled_back_version() -> None:
    store, clock = MemoryStateStore(), Clock()
    canaries = CanaryStore(store, clock)
    canaries.start("digits", 2, 50, stable=1)
    canaries.rollback("digits", 2, "p99")
    router = make_router(store, clock, VersionedBackend(clock))
    assert router.infer(path=PINNED).status_code == 409
    # WHEN the operator allows pinned requests to rolled-back versions
    state = canaries.set_allow_pinned("digits", True)
    assert state.allow_pinned
    clock.advance(5.01)
    # THEN a pinned request is served by v2 again; unpinned ones still get v1
    assert router.infer(path=PINNED).headers[VERSION] == "2"
    assert router.infer().headers[VERSION] == "1"
    # AND refusing again, or restarting v2 as the canary, is followed too
    canaries.set_allow_pinned("digits", False)
    clock.advance(5.01)
    assert router.infer(path=PINNED).status_code == 409
    canaries.start("digits", 2, 10)
    clock.advance(5.01)
    assert router.infer(path=PINNED).headers[VERSION] == "2"
