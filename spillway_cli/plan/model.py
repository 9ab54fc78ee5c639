"""The cost model: a workload's traffic shape priced in each serving mode.

A workload has ``daily_requests``, of which ``peak_rps`` arrive during ``peak_hours`` and
the rest evenly over the other hours, plus ``offline_daily_records`` to score within
``offline_deadline_hours``. Each mode is priced per month (``hours_per_month`` / 24 days):

* **serverless** — the CPU-fallback Lambda: billed milliseconds (the measured mean, rounded
  up) × memory × the GB-second price, plus the request price. Concurrency is rate × mean
  duration (Little's law). Cold starts: every environment of the daily peak starts cold
  once, and a request arriving after an idle gap longer than ``lambda_idle_reclaim_s``
  (probability ``exp(-rate × reclaim)``) finds none warm. When more than 1% of requests
  are cold, the p99 is a cold start plus a warm p50; if that breaks the SLO the mode
  buys provisioned concurrency (peak concurrency during the peak hours, off-peak
  concurrency, at least one, otherwise), which removes the cold starts. Offline records
  run in full batches at the measured offline rate.
* **dedicated** — GPU-service tasks, one per instance, scaled on a schedule: enough tasks
  at peak and off-peak that each task's rate stays where its measured p99 meets the SLO
  (interpolated between measured loads, never past the heaviest). Offline records use
  the spare capacity first, then extra task-hours.
* **batch** — everything as AWS Batch jobs on Spot: rows / measured rows per second, plus
  one instance start per instance per day. Live requests wait for the daily job: a
  latency of about a day, which meets no interactive SLO.
* **routed mix** — what the router's policy does: a fixed number of GPU tasks all day,
  the excess over their capacity spilled to serverless, offline records in batch. The
  number of tasks is the cheapest that meets the SLO. Its p99 is the worst of the parts
  that carry at least 1% of the requests.

The router and API Gateway are in front of every live mode alike and are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pydantic import BaseModel, ConfigDict, Field, model_validator

from spillway.router.settings import RouterSettings
from spillway_cli.plan.inputs import BatchJob, ModelMeasured, Prices, Serverless

TAIL_SHARE = 0.01
"""A part of the traffic that carries more than this share sets the p99."""
DAY_S = 86_400.0


class Workload(BaseModel):
    """One model behind one route, as the profile describes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    model: str
    route: str | None = None
    daily_requests: float = Field(ge=0)
    peak_rps: float = Field(default=0.0, ge=0)
    peak_hours: float = Field(default=0.0, ge=0, le=24)
    slo_p99_ms: float = Field(gt=0)
    payload_bytes: int = Field(default=1024, ge=0)
    rows_per_request: int = Field(default=1, ge=1)
    offline_daily_records: float = Field(default=0.0, ge=0)
    offline_deadline_hours: float = Field(default=6.0, gt=0, le=24)

    @model_validator(mode="after")
    def _consistent(self) -> Workload:
        peak = self.peak_rps * self.peak_hours * 3600
        if peak > self.daily_requests * (1 + 1e-9):
            raise ValueError(
                f"{self.name}: the peak alone ({peak:,.0f} requests) exceeds daily_requests"
            )
        if 0 < self.peak_hours < 24 and self.off_peak_rps > self.peak_rps + 1e-9:
            raise ValueError(f"{self.name}: the off-peak rate exceeds peak_rps")
        return self

    @property
    def off_peak_rps(self) -> float:
        """The rate outside the peak hours."""
        if self.peak_hours >= 24:
            return self.peak_rps
        rest = self.daily_requests - self.peak_rps * self.peak_hours * 3600
        return max(0.0, rest) / ((24 - self.peak_hours) * 3600)

    def scaled(self, factor: float) -> Workload:
        """The same shape with every volume times ``factor``."""
        return self.model_copy(
            update={
                "daily_requests": self.daily_requests * factor,
                "peak_rps": self.peak_rps * factor,
                "offline_daily_records": self.offline_daily_records * factor,
            }
        )


class Profile(BaseModel):
    """A traffic profile: the workloads to plan."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workloads: list[Workload] = Field(min_length=1)


@dataclass(frozen=True)
class Shape:
    """Two rates and how long each lasts per day."""

    peak_rps: float
    off_rps: float
    peak_s: float
    off_s: float

    @classmethod
    def of(cls, w: Workload) -> Shape:
        return cls(w.peak_rps, w.off_peak_rps, w.peak_hours * 3600, (24 - w.peak_hours) * 3600)

    @property
    def daily(self) -> float:
        return self.peak_rps * self.peak_s + self.off_rps * self.off_s


@dataclass(frozen=True)
class Option:
    """One mode's answer for one workload."""

    mode: str
    usd_per_month: float
    p99_ms: float
    meets_slo: bool
    gpu_tasks: tuple[int, int] = (0, 0)
    """(peak, off-peak) tasks."""
    lambda_concurrency: int = 0
    provisioned: tuple[int, int] = (0, 0)
    """(peak, off-peak) provisioned concurrency."""
    offline_done_s: float | None = None
    """How long the day's offline records take (``None``: there are none)."""
    notes: str = ""
    parts: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LambdaPart:
    """Serverless traffic of one shape: its monthly cost, p99 and concurrency."""

    usd: float
    p99_ms: float
    concurrency: int
    provisioned: tuple[int, int]


def serverless_part(shape: Shape, s: Serverless, prices: Prices, slo_ms: float) -> LambdaPart:
    """The cheapest serverless configuration of ``shape`` that meets ``slo_ms`` (on
    demand, else with provisioned concurrency); its p99 says whether it does."""
    if shape.daily <= 0:
        return LambdaPart(0.0, 0.0, 0, (0, 0))
    gb, cpu, plan, days = prices.lambda_gb, prices.router.cpu, prices.plan, prices.days_per_month
    billed_s = math.ceil(s.mean_ms) / 1000
    requests = shape.daily * days
    peak_c, off_c = shape.peak_rps * s.mean_ms / 1000, shape.off_rps * s.mean_ms / 1000
    reclaim = plan.lambda_idle_reclaim_s
    cold = float(math.ceil(max(peak_c, off_c)))
    cold += shape.off_rps * shape.off_s * math.exp(-shape.off_rps * reclaim)
    cold += shape.peak_rps * shape.peak_s * math.exp(-shape.peak_rps * reclaim)
    cold_p99 = s.init_ms + s.p50_ms if cold / shape.daily > TAIL_SHARE else s.p99_ms
    concurrency = math.ceil(max(peak_c, off_c))
    on_demand = requests * (billed_s * gb * cpu.usd_per_gb_second + cpu.usd_per_request)
    if cold_p99 <= slo_ms or s.p99_ms > slo_ms:
        return LambdaPart(on_demand, cold_p99, concurrency, (0, 0))
    held = (
        math.ceil(peak_c) if shape.peak_s else 0,
        max(1, math.ceil(off_c)) if shape.off_s else 0,
    )
    held_s = (held[0] * shape.peak_s + held[1] * shape.off_s) * days
    usd = held_s * gb * plan.lambda_provisioned_usd_per_gb_second
    usd += requests * (billed_s * gb * plan.lambda_provisioned_duration_usd_per_gb_second)
    usd += requests * cpu.usd_per_request
    return LambdaPart(usd, s.p99_ms, concurrency, held)


def offline_on_lambda(
    records: float, deadline_h: float, m: ModelMeasured, prices: Prices
) -> tuple[float, float | None]:
    """Monthly cost of scoring ``records`` per day with the function in full batches, and
    how long it takes with enough concurrent invocations to meet the deadline."""
    if records <= 0:
        return 0.0, None
    seconds = records / m.serverless.offline_rows_per_s
    calls = math.ceil(records / m.batch.batch_size)
    cpu = prices.router.cpu
    daily = seconds * prices.lambda_gb * cpu.usd_per_gb_second + calls * cpu.usd_per_request
    workers = max(1, math.ceil(seconds / (deadline_h * 3600)))
    return daily * prices.days_per_month, seconds / workers + m.serverless.init_ms / 1000


@dataclass(frozen=True)
class BatchPart:
    """Records scored by a daily Batch job: its monthly cost and its latency."""

    usd: float
    latency_s: float
    instances: int


def batch_part(records: float, deadline_h: float, b: BatchJob, prices: Prices) -> BatchPart:
    """Enough Spot instances to finish ``records`` within the deadline, billed for their
    run time plus one start each."""
    if records <= 0:
        return BatchPart(0.0, 0.0, 0)
    start = prices.plan.batch_start_s
    window = max(deadline_h * 3600 - start, 1.0)
    instances = math.ceil(records / (b.rows_per_s * window))
    run_s = records / (b.rows_per_s * instances)
    hours = (records / b.rows_per_s + instances * start) / 3600
    return BatchPart(
        hours * prices.plan.batch_spot_usd_per_hour * prices.days_per_month,
        start + run_s,
        instances,
    )


def _tasks(rows_per_s: float, rate: float) -> int:
    return max(1, math.ceil(rows_per_s / rate - 1e-9)) if rows_per_s > 0 else 0


def dedicated(w: Workload, m: ModelMeasured, prices: Prices) -> Option:
    """GPU tasks on a peak / off-peak schedule, offline records in their spare capacity."""
    d, shape, rows = m.dedicated, Shape.of(w), w.rows_per_request
    within = d.rate_within(w.slo_p99_ms)
    rate = within if within is not None else d.max_rows_per_s
    peak = _tasks(shape.peak_rps * rows, rate) if shape.peak_s else 0
    off = _tasks(shape.off_rps * rows, rate) if shape.off_s else 0
    task_s = peak * shape.peak_s + off * shape.off_s
    busiest = max(
        shape.peak_rps * rows / peak if peak else 0.0, shape.off_rps * rows / off if off else 0.0
    )
    spare = task_s * d.max_rows_per_s - shape.daily * rows
    extra_s = max(0.0, w.offline_daily_records - spare) / d.max_rows_per_s
    usd_per_s = prices.router.gpu.usd_per_hour / 3600 * prices.days_per_month
    live, offline = task_s * usd_per_s, extra_s * usd_per_s
    p99 = d.latency_at(busiest) if shape.daily else 0.0
    done: float | None = None
    notes = [] if within is not None or not shape.daily else ["p99 over the SLO at any load"]
    if w.offline_daily_records:
        workers = max(1, peak, off, math.ceil(extra_s / (w.offline_deadline_hours * 3600)))
        done = w.offline_daily_records / (d.max_rows_per_s * workers)
        notes.append(
            f"offline: +{extra_s / 3600:,.1f} task-hours/day"
            if extra_s
            else "offline in spare capacity"
        )
    return Option(
        "dedicated",
        live + offline,
        p99,
        (within is not None or not shape.daily) and p99 <= w.slo_p99_ms,
        gpu_tasks=(peak, off),
        offline_done_s=done,
        notes="; ".join(notes),
        parts={"gpu": live, "gpu offline": offline},
    )


def serverless(w: Workload, m: ModelMeasured, prices: Prices) -> Option:
    """Live requests and offline records on the CPU-fallback function."""
    if w.payload_bytes > RouterSettings.model_fields["max_body_bytes"].default:
        return Option("serverless", math.inf, math.inf, False, notes="payload over Lambda's limit")
    part = serverless_part(Shape.of(w), m.serverless, prices, w.slo_p99_ms)
    offline, done = offline_on_lambda(w.offline_daily_records, w.offline_deadline_hours, m, prices)
    notes = ""
    if any(part.provisioned):
        notes = "provisioned concurrency removes the cold starts"
    elif part.p99_ms > m.serverless.p99_ms:
        notes = "cold starts set the p99"
    return Option(
        "serverless",
        part.usd + offline,
        part.p99_ms,
        part.p99_ms <= w.slo_p99_ms,
        lambda_concurrency=part.concurrency,
        provisioned=part.provisioned,
        offline_done_s=done,
        notes=notes,
        parts={"lambda": part.usd, "lambda offline": offline},
    )


def batch(w: Workload, m: ModelMeasured, prices: Prices) -> Option:
    """Every request and record in daily Batch jobs on Spot."""
    live = batch_part(w.daily_requests * w.rows_per_request, 24, m.batch, prices)
    offline = batch_part(w.offline_daily_records, w.offline_deadline_hours, m.batch, prices)
    wait_ms = (DAY_S + live.latency_s) * 1000 if w.daily_requests else 0.0
    notes = ["live requests wait for the daily job"] if w.daily_requests else []
    if w.offline_daily_records:
        notes.append(f"offline: {offline.instances} Spot instance(s)")
    return Option(
        "batch",
        live.usd + offline.usd,
        wait_ms,
        wait_ms <= w.slo_p99_ms,
        offline_done_s=offline.latency_s if w.offline_daily_records else None,
        notes="; ".join(notes),
        parts={"batch": live.usd, "batch offline": offline.usd},
    )


def routed_mix(w: Workload, m: ModelMeasured, prices: Prices) -> Option:
    """A fixed GPU tier with the excess spilled to serverless and offline in batch: the
    cheapest tier size that meets the SLO (the cheapest overall when none does)."""
    d, shape, rows = m.dedicated, Shape.of(w), w.rows_per_request
    within = d.rate_within(w.slo_p99_ms)
    rate = within if within is not None else d.max_rows_per_s
    offline = batch_part(w.offline_daily_records, w.offline_deadline_hours, m.batch, prices)
    most = _tasks(max(shape.peak_rps, shape.off_rps) * rows, rate)
    usd_per_task = prices.router.gpu.usd_per_hour * 24 * prices.days_per_month
    options = []
    for tasks in range(min(1, most), most + 1):
        capacity = tasks * rate / rows
        spill = replace(
            shape,
            peak_rps=max(0.0, shape.peak_rps - capacity),
            off_rps=max(0.0, shape.off_rps - capacity),
        )
        part = serverless_part(spill, m.serverless, prices, w.slo_p99_ms)
        on_gpu = shape.daily - spill.daily
        busiest = min(max(shape.peak_rps, shape.off_rps), capacity) * rows / max(tasks, 1)
        tails = [d.latency_at(busiest)] if on_gpu > TAIL_SHARE * shape.daily else []
        tails += [part.p99_ms] if spill.daily > TAIL_SHARE * shape.daily else []
        p99 = max(tails, default=0.0)
        notes = [f"{spill.daily / shape.daily:.1%} spilled to serverless"] if shape.daily else []
        notes += ["offline in batch"] if w.offline_daily_records else []
        options.append(
            Option(
                "routed mix",
                tasks * usd_per_task + part.usd + offline.usd,
                p99,
                p99 <= w.slo_p99_ms,
                gpu_tasks=(tasks, tasks),
                lambda_concurrency=part.concurrency,
                provisioned=part.provisioned,
                offline_done_s=offline.latency_s if w.offline_daily_records else None,
                notes="; ".join(notes),
                parts={"gpu": tasks * usd_per_task, "lambda": part.usd, "batch": offline.usd},
            )
        )
    meeting = [o for o in options if o.meets_slo]
    return min(meeting or options, key=lambda o: o.usd_per_month)


MODES = (serverless, dedicated, batch, routed_mix)


def plan_workload(w: Workload, m: ModelMeasured, prices: Prices) -> list[Option]:
    """Every mode's option for one workload."""
    return [mode(w, m, prices) for mode in MODES]
