"""The routing policy: every matcher, the actions, time windows, and bad policy files."""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spillway.policy.decision import Decision, SpillState, decide, explain
from spillway.policy.facts import RequestFacts
from spillway.policy.rules import Policy, PolicyError, parse_policy

EXAMPLE = Path(__file__).resolve().parents[2] / "policies" / "example.yaml"
NOON = datetime(2026, 1, 15, 12, 0, tzinfo=UTC)


class FakeLoad:
    """A load view that is hot for one backend at one level, for a given time."""

    def __init__(self, backend: str = "gpu", busy: float = 0.0, for_s: float = 0.0) -> None:
        self.backend, self.busy, self.for_s = backend, busy, for_s

    def sustained_above(self, backend: str, threshold: float, for_s: float) -> bool:
        return backend == self.backend and self.busy > threshold and self.for_s >= for_s


COOL = FakeLoad()


def facts(**values: Any) -> RequestFacts:
    base: dict[str, Any] = {
        "method": "POST",
        "path": "/v2/models/digits/infer",
        "operation": "infer",
        "model": "digits",
    }
    return RequestFacts(**{**base, **values})


def one_rule(match: dict[str, Any], **extra: Any) -> Policy:
    """A policy whose first rule ``hit`` has ``match`` and whose default is ``miss``."""
    rule = {"name": "hit", "match": match, "route": "cpu", **extra}
    return Policy.model_validate({"rules": [rule, {"name": "miss", "route": "gpu"}]})


def fired(policy: Policy, request: RequestFacts, when: datetime = NOON, load: Any = COOL) -> str:
    return decide(policy, request, when, load, SpillState(random.Random(0))).rule


@pytest.mark.parametrize(
    ("match", "hit", "miss"),
    [
        ({"path": ["/v2/models/*/infer"]}, {}, {"path": "/v2/models/digits"}),
        ({"mode": ["serverless"]}, {"mode": "serverless"}, {"mode": "realtime"}),
        ({"model": ["dig*"]}, {"model": "digits"}, {"model": "minilm"}),
        ({"latency_budget_ms": {"lt": 100}}, {"latency_budget_ms": 99.0}, {}),
        (
            {"latency_budget_ms": {"gt": 1000}},
            {"latency_budget_ms": 1500.0},
            {"latency_budget_ms": 1000.0},
        ),
        ({"priority": {"ge": 2}}, {"priority": 3}, {"priority": 1}),
        ({"tenant": ["acme-*"]}, {"tenant": "acme-eu"}, {"tenant": "other"}),
        ({"payload_bytes": {"gt": 1000}}, {"payload_bytes": 1001}, {"payload_bytes": 1000}),
        ({"input_elements": {"ge": 640}}, {"input_elements": 640}, {"input_elements": 639}),
        ({"input_tokens": {"lt": 50}}, {"input_tokens": 10}, {"input_tokens": 50}),
    ],
    ids=[
        "path",
        "mode",
        "model",
        "budget-lt",
        "budget-gt",
        "priority",
        "tenant",
        "payload",
        "elements",
        "tokens",
    ],
)
def test_each_matcher_matches_and_misses(
    match: dict[str, Any], hit: dict[str, Any], miss: dict[str, Any]
) -> None:
    # GIVEN a policy whose first rule has one condition
    policy = one_rule(match)
    # WHEN requests that do and do not satisfy it are decided
    # THEN the first fires the rule, the second falls through to the default
    assert fired(policy, facts(**hit)) == "hit"
    assert fired(policy, facts(**miss)) == "miss"


def test_mode_and_priority_defaults_apply_to_requests_that_do_not_say() -> None:
    policy = Policy.model_validate(
        {
            "defaults": {"mode": "serverless", "priority": 2},
            "rules": [
                {
                    "name": "low",
                    "match": {"mode": ["serverless"], "priority": {"ge": 2}},
                    "route": "cpu",
                },
                {"name": "default", "route": "gpu"},
            ],
        }
    )
    assert fired(policy, facts()) == "low"
    assert fired(policy, facts(priority=1)) == "default"
    assert fired(policy, facts(mode="realtime")) == "default"


def test_tenant_tier_comes_from_the_tenant_map_with_a_default_tier() -> None:
    policy = Policy.model_validate(
        {
            "tenants": {"acme": "premium"},
            "defaults": {"tenant_tier": "free"},
            "rules": [
                {"name": "premium", "match": {"tenant_tier": ["premium"]}, "route": "gpu"},
                {"name": "free", "match": {"tenant_tier": ["free"]}, "route": "cpu"},
                {"name": "default", "route": "gpu"},
            ],
        }
    )
    assert fired(policy, facts(tenant="acme")) == "premium"
    assert fired(policy, facts(tenant="someone")) == "free"
    assert fired(policy, facts()) == "free"


@pytest.mark.parametrize(
    ("window", "when", "inside"),
    [
        # 09:00-17:00 Paris; Paris is UTC+1 in January, UTC+2 in July.
        (
            {"start": "09:00", "end": "17:00", "tz": "Europe/Paris"},
            "2026-01-15T07:59:00+00:00",
            False,
        ),
        (
            {"start": "09:00", "end": "17:00", "tz": "Europe/Paris"},
            "2026-01-15T08:00:00+00:00",
            True,
        ),
        (
            {"start": "09:00", "end": "17:00", "tz": "Europe/Paris"},
            "2026-07-15T07:00:00+00:00",
            True,
        ),
        (
            {"start": "09:00", "end": "17:00", "tz": "Europe/Paris"},
            "2026-07-15T15:00:00+00:00",
            False,
        ),
        # 22:00-06:00 New York runs across midnight, on both sides of it.
        (
            {"start": "22:00", "end": "06:00", "tz": "America/New_York"},
            "2026-01-16T03:30:00+00:00",
            True,
        ),
        (
            {"start": "22:00", "end": "06:00", "tz": "America/New_York"},
            "2026-01-16T10:59:00+00:00",
            True,
        ),
        (
            {"start": "22:00", "end": "06:00", "tz": "America/New_York"},
            "2026-01-16T11:00:00+00:00",
            False,
        ),
        (
            {"start": "22:00", "end": "06:00", "tz": "America/New_York"},
            "2026-01-16T02:59:00+00:00",
            False,
        ),
        # With days, a window across midnight belongs to the day it starts on:
        # Friday 22:00 to Saturday 06:00 Tokyo (UTC+9).
        (
            {"start": "22:00", "end": "06:00", "tz": "Asia/Tokyo", "days": ["fri"]},
            "2026-01-16T13:00:00+00:00",
            True,
        ),
        (
            {"start": "22:00", "end": "06:00", "tz": "Asia/Tokyo", "days": ["fri"]},
            "2026-01-16T20:00:00+00:00",
            True,
        ),
        (
            {"start": "22:00", "end": "06:00", "tz": "Asia/Tokyo", "days": ["fri"]},
            "2026-01-17T13:00:00+00:00",
            False,
        ),
        (
            {"start": "22:00", "end": "06:00", "tz": "Asia/Tokyo", "days": ["fri"]},
            "2026-01-15T20:00:00+00:00",
            False,
        ),
    ],
)
def test_time_windows_with_time_zones_and_midnight(
    window: dict[str, Any], when: str, inside: bool
) -> None:
    # GIVEN a rule with a time window in some zone
    policy = one_rule({"time_window": window})
    # WHEN a request arrives at the given UTC instant
    rule = fired(policy, facts(), datetime.fromisoformat(when))
    # THEN it fires exactly when the local time is inside the window
    assert rule == ("hit" if inside else "miss")


def test_load_condition_needs_the_level_and_the_duration() -> None:
    policy = one_rule({"load": {"backend": "gpu", "busy_above": 0.85, "for_s": 300}})
    assert fired(policy, facts(), load=FakeLoad("gpu", 0.9, 300)) == "hit"
    assert fired(policy, facts(), load=FakeLoad("gpu", 0.9, 299)) == "miss"
    assert fired(policy, facts(), load=FakeLoad("gpu", 0.85, 900)) == "miss"
    assert fired(policy, facts(), load=FakeLoad("cpu", 0.99, 900)) == "miss"


def test_route_chain_uses_rule_fallback_else_policy_fallbacks() -> None:
    policy = Policy.model_validate(
        {
            "fallbacks": {"gpu": ["cpu"], "cpu": ["gpu"]},
            "rules": [
                {"name": "solo", "match": {"mode": ["realtime"]}, "route": "gpu", "fallback": []},
                {"name": "cpu-first", "match": {"mode": ["serverless"]}, "route": "cpu"},
                {"name": "default", "route": "gpu"},
            ],
        }
    )
    spills = SpillState(random.Random(0))
    assert decide(policy, facts(mode="realtime"), NOON, COOL, spills) == Decision("solo", ("gpu",))
    assert decide(policy, facts(mode="serverless"), NOON, COOL, spills).chain == ("cpu", "gpu")
    assert decide(policy, facts(), NOON, COOL, spills).chain == ("gpu", "cpu")


def test_metadata_requests_skip_batch() -> None:
    policy = one_rule({"model": ["digits"]}, route="batch")
    decision = decide(policy, facts(operation="metadata"), NOON, COOL, SpillState(random.Random(0)))
    assert decision.rule == "hit"
    assert "batch" not in decision.chain
    assert decision.chain[0] == "gpu"


def test_spill_share_is_within_five_percent_over_2000_requests() -> None:
    # GIVEN the example's spill rule with the GPU tier hot for 5 minutes
    policy = parse_policy(EXAMPLE.read_text(), "example")
    spills = SpillState(random.Random(2026))
    hot = FakeLoad("gpu", 0.95, 301)
    # WHEN 2,000 low-priority requests are decided
    decisions = [decide(policy, facts(priority=3), NOON, hot, spills) for _ in range(2000)]
    # THEN all fire the spill rule and 10% (±5% of that) spill to the CPU fallback first
    assert {d.rule for d in decisions} == {"hot-gpu-spill-low-priority"}
    spilled = [d for d in decisions if d.spilled]
    assert 190 <= len(spilled) <= 210
    assert {d.chain for d in spilled} == {("cpu", "gpu")}
    assert {d.chain for d in decisions if not d.spilled} == {("gpu", "cpu")}
    # AND the spilled ones are spread out, not every tenth request
    where = [i for i, d in enumerate(decisions) if d.spilled]
    gaps = {b - a for a, b in itertools.pairwise(where)}
    assert len(gaps) > 3


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), share=st.floats(0.01, 1.0), n=st.integers(1, 3000))
def test_spilled_count_stays_within_two_of_the_share(seed: int, share: float, n: int) -> None:
    spills = SpillState(random.Random(seed))
    count = sum(spills.draw("rule", share) for _ in range(n))
    assert abs(count - share * n) <= 2


def test_a_cool_gpu_does_not_spill() -> None:
    policy = parse_policy(EXAMPLE.read_text(), "example")
    spills = SpillState(random.Random(1))
    rules = {decide(policy, facts(priority=3), NOON, COOL, spills).rule for _ in range(200)}
    assert rules == {"default"}


@pytest.mark.parametrize(
    ("request_facts", "when", "rule"),
    [
        ({"mode": "batch"}, NOON, "batch-requested"),
        ({"tenant": "trust-safety"}, datetime(2026, 1, 15, 1, 30, tzinfo=UTC), "nightly-rescoring"),
        ({"tenant": "trust-safety"}, NOON, "default"),
        ({"mode": "realtime", "priority": 5}, NOON, "realtime"),
        ({"latency_budget_ms": 100.0}, NOON, "tight-budget"),
        ({"tenant": "moderation-live"}, NOON, "premium-tenants"),
        ({"mode": "serverless"}, NOON, "serverless-requested"),
        ({"payload_bytes": 2_000_000}, NOON, "large-bodies-never-spill"),
        ({}, NOON, "default"),
    ],
)
def test_example_policy_encodes_the_content_moderation_scenario(
    request_facts: dict[str, Any], when: datetime, rule: str
) -> None:
    policy = parse_policy(EXAMPLE.read_text(), "example")
    assert fired(policy, facts(**request_facts), when) == rule


def test_explain_gives_a_reason_for_every_rule_before_the_one_that_fires() -> None:
    policy = parse_policy(EXAMPLE.read_text(), "example")
    traces = explain(policy, facts(mode="serverless"), NOON, COOL)
    assert [t.rule for t in traces] == [r.name for r in policy.rules[:6]]
    assert [t.matched for t in traces] == [False] * 5 + [True]
    assert traces[0].reason == "mode serverless is not one of ['batch']"
    assert traces[3].reason == "latency_budget_ms None is out of range"


def then_default(condition: str, key: str = "time_window") -> str:
    """A two-rule policy whose first rule has one ``key: condition``."""
    first = f"{{name: a, match: {{{key}: {condition}}}, route: gpu}}"
    return f"rules:\n  - {first}\n  - {{name: b, route: gpu}}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules: []", "rules: List should have at least 1 item"),
        ("{}", "rules: Field required"),
        (
            "rules:\n  - {name: a, route: gpu, colour: red}",
            "rules.0.colour: Extra inputs are not permitted",
        ),
        (
            "rules:\n  - {name: a, route: tpu}",
            "rules.0.route: Input should be 'gpu', 'cpu' or 'batch'",
        ),
        ("rules:\n  - {name: a, match: {mode: [realtime]}, route: gpu}", "must have no match"),
        (
            "rules:\n  - {name: a, route: gpu}\n  - {name: b, route: cpu}",
            "rule 'a' matches everything, so 'b' never fires",
        ),
        (
            "rules:\n  - {name: a, match: {mode: [batch]}, route: batch}\n"
            "  - {name: a, route: gpu}",
            "repeated: a",
        ),
        ("rules:\n  - {name: a, route: gpu, spill: {share: 0.1, to: gpu}}", "spill.to must differ"),
        ("rules:\n  - {name: a, route: gpu, spill: {share: 1.5, to: cpu}}", "rules.0.spill.share"),
        ("rules:\n  - {name: a, route: gpu, fallback: [gpu]}", "fallback may not contain"),
        (
            then_default("{start: '22:00', end: '06:00', tz: Mars/Base}"),
            "unknown time zone 'Mars/Base'",
        ),
        (
            then_default("{start: '25:00', end: '06:00'}"),
            "'25:00' is not a 24-hour HH:MM time",
        ),
        (
            then_default("{start: '06:00', end: '06:00'}"),
            "start equals end",
        ),
        (
            then_default("{}", key="latency_budget_ms"),
            "give at least one of lt, le, gt, ge",
        ),
        ("rules:\n  - {name: Bad Name, route: gpu}", "rules.0.name: String should match pattern"),
        ("rules: [unclosed", "invalid YAML"),
        ('{"rules": [}', "invalid JSON"),
        ("- just\n- a list", "a policy is a mapping"),
        ("version: 2\nrules:\n  - {name: a, route: gpu}", "version: Input should be 1"),
    ],
)
def test_bad_policies_are_refused_with_a_clear_reason(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "bad.yaml")
    assert str(caught.value).startswith("bad.yaml: ")
    assert message in str(caught.value)


def test_the_example_policy_is_valid_json_too() -> None:
    import json

    import yaml

    data = yaml.safe_load(EXAMPLE.read_text())
    assert parse_policy(json.dumps(data), "example.json") == parse_policy(EXAMPLE.read_text())
