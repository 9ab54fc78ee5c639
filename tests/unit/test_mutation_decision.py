"""What the mutation run of spillway/policy/decision.py found untested (docs/mutation.md):
the tier's priority floor, the reasons ``explain`` gives word for word, spill credit kept
per rule, the batch backend kept for inference, and a policy that ends without a
match-all rule failing loudly."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from spillway.policy.decision import SpillState, decide, explain, with_allowed_priority
from spillway.policy.facts import RequestFacts
from spillway.policy.rules import Policy

NOON = datetime(2026, 1, 15, 12, 0, tzinfo=UTC)


class Load:
    """A load view with one backend hot (or none)."""

    def __init__(self, hot: str | None = None) -> None:
        self.hot = hot

    def sustained_above(self, backend: str, threshold: float, for_s: float) -> bool:
        return backend == self.hot


def facts(**values: Any) -> RequestFacts:
    base: dict[str, Any] = {
        "method": "POST",
        "path": "/v2/models/digits/infer",
        "operation": "infer",
        "model": "digits",
    }
    return RequestFacts(**{**base, **values})


def policy(*rules: dict[str, Any], **extra: Any) -> Policy:
    return Policy.model_validate({"rules": [*rules, {"name": "default", "route": "gpu"}], **extra})


# --- the priority a tenant's tier allows ----------------------------------------------

TIERED = policy(
    tenants={"acme": "standard", "vip": "premium"},
    tier_priorities={"standard": 3},
    defaults={"tenant_tier": "premium"},
)


def test_a_request_asking_above_its_tier_is_served_at_the_tier_floor() -> None:
    # GIVEN acme, of the standard tier whose callers may use priority 3 at best
    asked = facts(tenant="acme", priority=1)
    # WHEN acme asks for priority 1
    allowed = with_allowed_priority(TIERED, asked)
    # THEN it gets 3, and nothing else of the request changes
    assert allowed.priority == 3
    assert allowed == replace(asked, priority=3)


@pytest.mark.parametrize(
    ("tenant", "priority"),
    [("acme", 5), ("acme", 3), ("vip", 1), (None, 1), ("acme", None)],
    ids=["below-floor", "at-floor", "tier-without-floor", "no-tenant-default-tier", "none"],
)
def test_a_request_within_its_tier_keeps_its_priority(
    tenant: str | None, priority: int | None
) -> None:
    asked = facts(tenant=tenant, priority=priority)
    assert with_allowed_priority(TIERED, asked) == asked
    assert with_allowed_priority(TIERED, asked).priority == priority


# --- explain's reasons ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("match", "request_facts", "reason"),
    [
        ({"payload_bytes": {"gt": 10}}, {"payload_bytes": 5}, "payload_bytes 5 is out of range"),
        (
            {"input_elements": {"ge": 640}},
            {"input_elements": 639},
            "input_elements 639 is out of range",
        ),
        ({"input_tokens": {"lt": 50}}, {"input_tokens": 50}, "input_tokens 50 is out of range"),
    ],
    ids=["payload_bytes", "input_elements", "input_tokens"],
)
def test_explain_names_the_size_condition_that_failed(
    match: dict[str, Any], request_facts: dict[str, Any], reason: str
) -> None:
    traces = explain(
        policy({"name": "sized", "match": match, "route": "cpu"}),
        facts(**request_facts),
        NOON,
        Load(),
    )
    assert [(t.rule, t.matched, t.reason) for t in traces] == [
        ("sized", False, reason),
        ("default", True, "all conditions hold"),
    ]


def test_explain_judges_time_and_load_at_the_time_and_load_it_is_given() -> None:
    # GIVEN a rule for a hot GPU at noon
    rules = policy(
        {
            "name": "hot-noon",
            "match": {
                "time_window": {"start": "11:00", "end": "13:00"},
                "load": {"backend": "gpu", "busy_above": 0.8, "for_s": 60},
            },
            "route": "cpu",
        }
    )
    # THEN at noon with the GPU hot it matches, and the trace says so
    hot = explain(rules, facts(), NOON, Load("gpu"))
    assert [(t.rule, t.matched, t.reason) for t in hot] == [
        ("hot-noon", True, "all conditions hold")
    ]
    # AND with the GPU cool, the load condition is the reason
    cool = explain(rules, facts(), NOON, Load())
    assert cool[0].reason == "gpu has not been above 0.8 busy for 60.0 s"


# --- decisions -------------------------------------------------------------------------


def test_inference_keeps_the_batch_backend_first() -> None:
    # GIVEN a rule that routes to the batch backend
    rules = policy({"name": "to-batch", "match": {"model": ["digits"]}, "route": "batch"})
    # WHEN an inference request fires it
    decision = decide(rules, facts(), NOON, Load(), SpillState(random.Random(0)))
    # THEN batch is tried first (only non-inference requests skip it)
    assert decision.rule == "to-batch"
    assert decision.chain[0] == "batch"


def test_each_rule_keeps_its_own_spill_credit() -> None:
    # GIVEN two spilling rules, one spilling 90 % and one 10 %
    rules = policy(
        {
            "name": "most",
            "match": {"mode": ["realtime"]},
            "route": "gpu",
            "spill": {"share": 0.9, "to": "cpu"},
        },
        {
            "name": "few",
            "match": {"mode": ["serverless"]},
            "route": "gpu",
            "spill": {"share": 0.1, "to": "cpu"},
        },
    )
    spills = SpillState(random.Random(7))
    # WHEN 200 requests alternate between them
    decisions = [
        decide(rules, facts(mode=mode), NOON, Load(), spills)
        for _ in range(100)
        for mode in ("realtime", "serverless")
    ]
    # THEN each rule spills its own share (within two requests of it), not a shared one
    spilled = {
        name: sum(d.spilled for d in decisions if d.rule == name) for name in ("most", "few")
    }
    assert abs(spilled["most"] - 90) <= 2
    assert abs(spilled["few"] - 10) <= 2


class _Zero(random.Random):
    """A generator whose every draw is 0.0, the lowest ``random()`` can give."""

    def random(self) -> float:
        return 0.0


def test_a_spill_credit_of_zero_never_spills_even_on_a_zero_draw() -> None:
    spills = SpillState(_Zero())
    assert [spills.draw("rule", 0.0) for _ in range(3)] == [False, False, False]
    # AND any positive credit spills on that draw
    assert spills.draw("other", 0.01) is True


def test_a_policy_without_a_match_all_rule_fails_loudly() -> None:
    # GIVEN a policy whose last rule was cut off after validation
    rules = policy({"name": "only", "match": {"mode": ["batch"]}, "route": "batch"})
    cut = rules.model_copy(update={"rules": rules.rules[:1]})
    # WHEN a request that no rule matches is decided
    with pytest.raises(AssertionError) as failed:
        decide(cut, facts(mode="realtime"), NOON, Load(), SpillState(random.Random(0)))
    # THEN it fails with the reason, not with a decision
    assert str(failed.value) == "a validated policy ends with a rule that matches everything"
