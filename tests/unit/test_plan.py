"""The planner against the worked example of docs/planning.md, figure by figure.

Every expected value below is the hand computation the document shows, written out as
arithmetic on the example's inputs (docs/examples/plan-*.yaml); the document's tables are
the planner's output verbatim.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from spillway_cli.plan import inputs
from spillway_cli.plan.model import Option, Profile, Workload, dedicated, serverless
from spillway_cli.plan.report import WorkloadPlan, make_plan, workload_table

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
DAYS = 730 / 24
LAMBDA_GB_S, LAMBDA_REQUEST, GB = 0.0000166667, 0.0000002, 2.0
GPU_HOUR, SPOT_HOUR = 1.006, 0.45
PROVISIONED_GB_S, PROVISIONED_DURATION = 0.0000041667, 0.0000097222


@pytest.fixture(scope="module")
def plans() -> dict[str, WorkloadPlan]:
    profile: Profile = inputs.load_model(Profile, EXAMPLES / "plan-traffic.yaml")
    measured = inputs.load_measured(EXAMPLES / "plan-measured.yaml")
    prices = inputs.load_prices(EXAMPLES / "plan-pricing.yaml", EXAMPLES / "plan-prices.yaml")
    return {p.workload.name: p for p in make_plan(profile, measured, prices)}


def option(plan: WorkloadPlan, mode: str) -> Option:
    return next(o for o in plan.options if o.mode == mode)


def test_moderation_live_is_cheapest_on_lambda(plans: dict[str, WorkloadPlan]) -> None:
    plan = plans["moderation-live"]
    per_request = 0.010 * GB * LAMBDA_GB_S + LAMBDA_REQUEST
    on_lambda = option(plan, "serverless")
    assert on_lambda.usd_per_month == pytest.approx(8_640_000 * DAYS * per_request)
    assert round(on_lambda.usd_per_month, 2) == 140.16
    assert on_lambda.lambda_concurrency == 2  # 200 rps x 10 ms
    assert on_lambda.p99_ms == 20
    gpu = option(plan, "dedicated")
    assert gpu.gpu_tasks == (1, 1)  # 200 rps fits one task's 3,000 rows/s within 50 ms
    assert round(gpu.usd_per_month, 2) == round(24 * DAYS * GPU_HOUR, 2) == 734.38
    assert gpu.p99_ms == 4  # under the lightest measured load
    assert plan.cheapest is on_lambda
    break_even_daily = 24 * GPU_HOUR / per_request
    assert plan.break_even is not None
    assert 8_640_000 * plan.break_even == pytest.approx(break_even_daily, rel=1e-9)
    assert round(break_even_daily) == 45_269_943


def test_semantic_search_is_cheapest_on_one_gpu_task(plans: dict[str, WorkloadPlan]) -> None:
    plan = plans["semantic-search"]
    per_request = 0.025 * GB * LAMBDA_GB_S + LAMBDA_REQUEST
    on_lambda = option(plan, "serverless")
    assert round(on_lambda.usd_per_month, 2) == round(40e6 * DAYS * per_request, 2) == 1257.22
    assert on_lambda.lambda_concurrency == 20  # 800 rps x 25 ms
    gpu = option(plan, "dedicated")
    assert gpu.gpu_tasks == (1, 1)
    assert gpu.p99_ms == pytest.approx(6 + (800 - 200) / (1200 - 200) * (12 - 6))  # 9.6
    assert plan.cheapest is gpu
    assert plan.break_even is not None
    assert round(40e6 * plan.break_even) == round(24 * GPU_HOUR / per_request) == 23_365_124


def test_nightly_rescoring_is_cheapest_in_batch(plans: dict[str, WorkloadPlan]) -> None:
    plan = plans["nightly-rescoring"]
    batch = option(plan, "batch")
    run_s = 30e6 / 3000
    assert round(batch.usd_per_month, 2) == round((run_s + 300) / 3600 * SPOT_HOUR * DAYS, 2)
    assert round(batch.usd_per_month, 2) == 39.16
    assert batch.offline_done_s == 300 + run_s
    gpu = option(plan, "dedicated")
    assert round(gpu.usd_per_month, 2) == round(30e6 / 2400 / 3600 * GPU_HOUR * DAYS, 2) == 106.25
    on_lambda = option(plan, "serverless")
    lambda_day = 30e6 / 150 * GB * LAMBDA_GB_S + math.ceil(30e6 / 64) * LAMBDA_REQUEST
    assert round(on_lambda.usd_per_month, 2) == round(lambda_day * DAYS, 2) == 205.63
    assert on_lambda.offline_done_s == pytest.approx(200_000 / 10 + 2.5)  # 10 invocations
    assert plan.cheapest is batch


def test_checkout_fraud_buys_provisioned_concurrency(plans: dict[str, WorkloadPlan]) -> None:
    plan = plans["checkout-fraud"]
    off_rps = (500 - 0.05 * 2 * 3600) / (22 * 3600)
    cold = 1 + 140 * math.exp(-off_rps * 600) + 360 * math.exp(-0.05 * 600)
    assert cold / 500 > 0.01  # 9.9 %: the p99 would be 800 + 9 ms, over the 100 ms SLO
    on_lambda = option(plan, "serverless")
    assert on_lambda.provisioned == (1, 1)
    held = 86_400 * DAYS * GB * PROVISIONED_GB_S
    calls = 500 * DAYS * (0.010 * GB * PROVISIONED_DURATION + LAMBDA_REQUEST)
    assert on_lambda.usd_per_month == pytest.approx(held + calls)
    assert round(on_lambda.usd_per_month, 2) == 21.91
    assert on_lambda.p99_ms == 20
    assert plan.cheapest is on_lambda
    assert plan.break_even is None


def test_the_document_shows_the_planners_tables(plans: dict[str, WorkloadPlan]) -> None:
    document = (ROOT / "docs" / "planning.md").read_text()
    for plan in plans.values():
        assert workload_table(plan) in document


def test_an_slo_below_every_measured_latency_is_never_met() -> None:
    measured = inputs.load_measured(EXAMPLES / "plan-measured.yaml").model("digits")
    prices = inputs.load_prices(EXAMPLES / "plan-pricing.yaml", EXAMPLES / "plan-prices.yaml")
    tight = Workload(name="tight", model="digits", daily_requests=86_400, slo_p99_ms=3)
    assert not dedicated(tight, measured, prices).meets_slo  # the lightest load's p99 is 4
    assert not serverless(tight, measured, prices).meets_slo
    huge = tight.model_copy(update={"payload_bytes": 8_000_000, "slo_p99_ms": 100})
    assert math.isinf(serverless(huge, measured, prices).usd_per_month)


def test_a_peak_larger_than_the_day_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds daily_requests"):
        Workload(
            name="bad", model="digits", daily_requests=1000, peak_rps=1, peak_hours=1, slo_p99_ms=9
        )


def test_the_latency_curve_is_never_extrapolated() -> None:
    curve = inputs.load_measured(EXAMPLES / "plan-measured.yaml").model("digits").dedicated
    assert curve.latency_at(100) == 4
    assert curve.latency_at(1250) == pytest.approx(7)
    assert math.isinf(curve.latency_at(3001))
    assert curve.rate_within(25) == pytest.approx(2500)
    assert curve.rate_within(3.9) is None
