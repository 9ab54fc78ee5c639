"""A plan per workload: every mode's option, the cheapest that meets the SLO, where
serverless and dedicated break even, as a table for the terminal and a chart."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spillway_cli.plan.inputs import Measured, ModelMeasured, Prices
from spillway_cli.plan.model import Option, Profile, Workload, dedicated, plan_workload, serverless

Mode = Callable[[Workload, ModelMeasured, Prices], Option]
SCALES = [10 ** (e / 20) for e in range(-80, 61)]
"""Traffic multiples searched for a break-even: 1/10,000 to 1,000 times the profile."""


@dataclass(frozen=True)
class WorkloadPlan:
    """One workload's options and what they mean."""

    workload: Workload
    options: list[Option]
    break_even: float | None
    """The multiple of the profile's volumes at which dedicated becomes cheaper than
    serverless (``None``: not between 1/10,000 and 1,000 times)."""

    @property
    def cheapest(self) -> Option | None:
        """The cheapest option that meets the SLO."""
        meeting = [
            (round(o.usd_per_month, 2), i) for i, o in enumerate(self.options) if o.meets_slo
        ]
        return self.options[min(meeting)[1]] if meeting else None


def break_even(
    w: Workload, m: ModelMeasured, prices: Prices, low: Mode = serverless, high: Mode = dedicated
) -> float | None:
    """The smallest traffic multiple where ``high`` costs no more than ``low``, found on a
    grid and refined by bisection (both are step functions of traffic at worst)."""

    def gap(scale: float) -> float:
        scaled = w.scaled(scale)
        return low(scaled, m, prices).usd_per_month - high(scaled, m, prices).usd_per_month

    gaps = [gap(s) for s in SCALES]
    for i in range(1, len(SCALES)):
        if gaps[i - 1] < 0 <= gaps[i]:
            below, above = SCALES[i - 1], SCALES[i]
            for _ in range(60):
                middle = math.sqrt(below * above)
                below, above = (middle, above) if gap(middle) < 0 else (below, middle)
            return above
    return None


def make_plan(profile: Profile, measured: Measured, prices: Prices) -> list[WorkloadPlan]:
    """Plan every workload of the profile."""
    plans = []
    for w in profile.workloads:
        m = measured.model(w.model)
        plans.append(WorkloadPlan(w, plan_workload(w, m, prices), break_even(w, m, prices)))
    return plans


# --- the terminal table ----------------------------------------------------------------


def latency(ms: float) -> str:
    """A latency for people: milliseconds, else seconds, hours."""
    if math.isinf(ms):
        return "–"
    if ms < 10_000:
        return f"{ms:,.1f} ms"
    if ms < 3_600_000:
        return f"{ms / 1000:,.0f} s"
    return f"{ms / 3_600_000:,.1f} h"


def usd(value: float) -> str:
    return "–" if math.isinf(value) else f"{value:,.2f}"


def _tasks(option: Option) -> str:
    peak, off = option.gpu_tasks
    return f"{peak} / {off}" if peak or off else "–"


def _lambda(option: Option) -> str:
    if not option.lambda_concurrency:
        return "–"
    peak, off = option.provisioned
    held = f" (provisioned {peak} / {off})" if peak or off else ""
    return f"{option.lambda_concurrency}{held}"


def volume(w: Workload) -> float:
    """The figure the break-even is stated in: requests per day, or offline records when
    the workload has no live traffic."""
    return w.daily_requests or w.offline_daily_records


def workload_table(plan: WorkloadPlan) -> str:
    """One workload as a heading, its traffic, the options table and the verdicts."""
    w = plan.workload
    route = f", {w.route}" if w.route else ""
    traffic = []
    if w.daily_requests:
        traffic.append(
            f"{w.daily_requests:,.0f} requests/day (peak {w.peak_rps:,.2f} rps for "
            f"{w.peak_hours:g} h, off-peak {w.off_peak_rps:,.2f} rps), SLO p99 "
            f"{latency(w.slo_p99_ms)}, {w.payload_bytes:,} B payload"
        )
    if w.offline_daily_records:
        traffic.append(
            f"offline {w.offline_daily_records:,.0f} records/day within "
            f"{w.offline_deadline_hours:g} h"
        )
    lines = [
        f"## {w.name} — {w.model}{route}",
        "; ".join(traffic) or "no traffic",
        "",
        "| option | USD / month | p99 | meets SLO | GPU tasks (peak / off-peak) "
        "| Lambda concurrency | offline done in | notes |",
        "|---|---:|---:|---|---|---|---:|---|",
    ]
    for o in plan.options:
        p99 = latency(o.p99_ms) if w.daily_requests else "–"
        done = latency(o.offline_done_s * 1000) if o.offline_done_s is not None else "–"
        lines.append(
            f"| {o.mode} | {usd(o.usd_per_month)} | {p99} | {'yes' if o.meets_slo else 'no'} "
            f"| {_tasks(o)} | {_lambda(o)} | {done} | {o.notes} |"
        )
    best = plan.cheapest
    lines.append("")
    lines.append(
        f"Cheapest within the SLO: **{best.mode}**, {usd(best.usd_per_month)} USD/month."
        if best
        else "No option meets the SLO."
    )
    unit = "requests/day" if w.daily_requests else "records/day"
    if plan.break_even is not None:
        lines.append(
            f"Break-even: dedicated is cheaper than serverless from "
            f"{volume(w) * plan.break_even:,.0f} {unit} ({plan.break_even:.3g} × this profile)."
        )
    else:
        lines.append("Break-even: none between 1/10,000 and 1,000 times this profile.")
    return "\n".join(lines)


def header(measured: Measured, prices: Prices) -> str:
    """Where the inputs come from."""
    plan = prices.plan
    return (
        f"Prices as of {plan.as_of} ({plan.region}: {plan.gpu_instance} on demand "
        f"{prices.router.gpu.usd_per_hour:g} USD/h, Batch on Spot {plan.batch_instance} "
        f"{plan.batch_spot_usd_per_hour:g} USD/h, Lambda {prices.router.cpu.memory_mb} MB). "
        f"Measured on {measured.measured_on}: {measured.machine}."
    )


def table(plans: list[WorkloadPlan], measured: Measured, prices: Prices) -> str:
    """The whole plan as markdown."""
    return "\n\n".join([header(measured, prices), *(workload_table(p) for p in plans)])


def as_json(plans: list[WorkloadPlan]) -> list[dict[str, Any]]:
    """The plan as plain data (infinite figures as ``None``)."""

    def finite(value: float) -> float | None:
        return None if math.isinf(value) else value

    return [
        {
            "workload": p.workload.name,
            "model": p.workload.model,
            "cheapest": p.cheapest.mode if p.cheapest else None,
            "break_even_scale": p.break_even,
            "options": [
                {
                    "mode": o.mode,
                    "usd_per_month": finite(o.usd_per_month),
                    "p99_ms": finite(o.p99_ms),
                    "meets_slo": o.meets_slo,
                    "gpu_tasks": list(o.gpu_tasks),
                    "lambda_concurrency": o.lambda_concurrency,
                    "provisioned": list(o.provisioned),
                    "offline_done_s": o.offline_done_s,
                    "parts": o.parts,
                    "notes": o.notes,
                }
                for o in p.options
            ],
        }
        for p in plans
    ]


# --- the chart -------------------------------------------------------------------------


def chart(plans: list[WorkloadPlan], measured: Measured, prices: Prices, path: Path) -> Path:
    """Cost per month against traffic for every mode, one panel per workload, with the
    profile's traffic and the break-even marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(plans), 1, figsize=(8, 3.6 * len(plans)), squeeze=False)
    for ax, plan in zip(axes[:, 0], plans, strict=True):
        w, m = plan.workload, measured.model(plan.workload.model)
        scales = SCALES[::2]
        xs = [volume(w) * s for s in scales]
        curves = [plan_workload(w.scaled(s), m, prices) for s in scales]
        for index, option in enumerate(plan.options):
            points = [c[index] for c in curves]
            ys = [o.usd_per_month if math.isfinite(o.usd_per_month) else math.nan for o in points]
            meets = [y if o.meets_slo else math.nan for y, o in zip(ys, points, strict=True)]
            (line,) = ax.plot(xs, meets, label=option.mode)
            ax.plot(xs, ys, color=line.get_color(), linestyle=":", linewidth=1)
        ax.axvline(volume(w), color="#555", linestyle=":", linewidth=1)
        if plan.break_even is not None:
            at = w.scaled(plan.break_even)
            cost = dedicated(at, m, prices).usd_per_month
            ax.plot([volume(at)], [cost], "ko")
            ax.annotate(f" break-even\n {volume(at):,.0f}/day", (volume(at), cost), fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{w.name} ({w.model}, SLO p99 {latency(w.slo_p99_ms)})", fontsize=10)
        ax.set_xlabel("requests per day" if w.daily_requests else "offline records per day")
        ax.set_ylabel("USD per month")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Cost against traffic (prices as of {prices.plan.as_of}; dotted: misses the SLO)",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
