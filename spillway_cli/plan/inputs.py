"""The planner's and the tuner's inputs: measured figures per model, and prices.

**Measured** (``config/measured.yaml``, written by ``python -m bench.plan_inputs`` on the
hardware it runs on): per model, the GPU service's throughput and latency at a few
closed-loop loads (one task), the CPU fallback's time per request and its cold start (a
Lambda environment serves one request at a time), and the batch job's rows per second.

**Prices** come from two files so that no price is written twice: the router's
``config/pricing.yaml`` (Lambda GB-second and request prices, the CPU function's memory,
the GPU instance's hourly price, all used for ``x-spillway-cost-usd``) and
``config/plan-prices.yaml`` (dated: provisioned concurrency, Batch on Spot, hours per
month, and the two assumptions that are not prices but not measurable here either).
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from spillway.policy.accounting import Pricing, load_pricing

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "config" / "measured.yaml"
PLAN_PRICES = ROOT / "config" / "plan-prices.yaml"
ROUTER_PRICING = ROOT / "config" / "pricing.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoadPoint(_Strict):
    """One closed-loop load on one GPU-service task: the throughput it sustained and the
    latency its requests saw."""

    concurrency: int = Field(ge=1)
    rows_per_s: float = Field(gt=0)
    p50_ms: float = Field(gt=0)
    p99_ms: float = Field(gt=0)


class Dedicated(_Strict):
    """The GPU service (one task) for one model."""

    points: list[LoadPoint] = Field(min_length=1)
    load_ms: float = Field(ge=0)
    """Cold start of a version: fetch, load and warm."""

    @model_validator(mode="after")
    def _ordered(self) -> Dedicated:
        rates = [p.rows_per_s for p in self.points]
        if rates != sorted(rates):
            raise ValueError("points must be ordered by rows_per_s")
        return self

    @property
    def max_rows_per_s(self) -> float:
        """The most the task sustained."""
        return self.points[-1].rows_per_s

    def latency_at(self, rows_per_s: float, quantile: str = "p99_ms") -> float:
        """The latency quantile at a per-task rate: linear between the measured points,
        the lightest point's below them, infinite past the heaviest (never measured, so
        never promised)."""
        first, last = self.points[0], self.points[-1]
        if rows_per_s <= first.rows_per_s:
            return float(getattr(first, quantile))
        if rows_per_s > last.rows_per_s:
            return math.inf
        for low, high in zip(self.points, self.points[1:], strict=False):
            if rows_per_s <= high.rows_per_s:
                share = (rows_per_s - low.rows_per_s) / (high.rows_per_s - low.rows_per_s)
                below, above = getattr(low, quantile), getattr(high, quantile)
                return float(below + share * (above - below))
        return float(getattr(last, quantile))

    def rate_within(self, slo_ms: float) -> float | None:
        """The highest per-task rate whose p99 stays within ``slo_ms`` (``None``: not even
        the lightest load does)."""
        if self.points[0].p99_ms > slo_ms:
            return None
        best = self.points[0].rows_per_s
        for low, high in zip(self.points, self.points[1:], strict=False):
            if high.p99_ms <= slo_ms:
                best = high.rows_per_s
                continue
            share = (slo_ms - low.p99_ms) / (high.p99_ms - low.p99_ms)
            return low.rows_per_s + share * (high.rows_per_s - low.rows_per_s)
        return best


class Serverless(_Strict):
    """The CPU fallback for one model: one request of one row at a time."""

    p50_ms: float = Field(gt=0)
    p99_ms: float = Field(gt=0)
    mean_ms: float = Field(gt=0)
    init_ms: float = Field(ge=0)
    """Cold start: process start until the model is loaded and warm."""
    offline_rows_per_s: float = Field(gt=0)
    """Rows per second when a function works through offline records in full batches."""


class BatchJob(_Strict):
    """The batch job for one model, on the Batch instance type."""

    rows_per_s: float = Field(gt=0)
    batch_size: int = Field(ge=1)


class ModelMeasured(_Strict):
    """Everything measured for one model."""

    dedicated: Dedicated
    serverless: Serverless
    batch: BatchJob


class Measured(_Strict):
    """The measured-inputs file."""

    measured_on: dt.date
    machine: str
    providers: list[str] = Field(min_length=1)
    models: dict[str, ModelMeasured] = Field(min_length=1)

    def model(self, name: str) -> ModelMeasured:
        """The figures of one model; a clear error when it was never measured."""
        if name not in self.models:
            known = ", ".join(sorted(self.models))
            raise ValueError(f"model {name!r} has no measured figures (measured: {known})")
        return self.models[name]


class PlanPrices(_Strict):
    """What the router's pricing file does not hold, with the date the prices were read."""

    as_of: dt.date
    region: str
    hours_per_month: float = Field(default=730.0, gt=0)
    gpu_instance: str
    """The instance type whose hourly price is ``gpu.usd_per_hour`` in the router's file."""
    lambda_provisioned_usd_per_gb_second: float = Field(ge=0)
    """Provisioned concurrency: per GB-second configured, whether used or not."""
    lambda_provisioned_duration_usd_per_gb_second: float = Field(ge=0)
    """Duration of invocations served by provisioned environments."""
    batch_instance: str
    batch_spot_usd_per_hour: float = Field(gt=0)
    batch_start_s: float = Field(ge=0)
    """Assumption: a Batch job's wait for a Spot instance, its boot and image pull."""
    lambda_idle_reclaim_s: float = Field(gt=0)
    """Assumption: how long an idle Lambda environment stays warm (AWS does not say)."""


class Prices:
    """The router's pricing and the planner's additions, read together."""

    def __init__(self, router: Pricing, plan: PlanPrices) -> None:
        self.router = router
        self.plan = plan

    @property
    def lambda_gb(self) -> float:
        """Memory of the CPU-fallback function in GB."""
        return self.router.cpu.memory_mb / 1024

    @property
    def days_per_month(self) -> float:
        return self.plan.hours_per_month / 24


def _yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: {exc}") from None


Document = TypeVar("Document", bound=BaseModel)


def load_model(kind: type[Document], path: Path) -> Document:
    """A validated document of ``kind`` from a YAML file; ``ValueError`` says what is wrong."""
    try:
        return kind.model_validate(_yaml(path))
    except ValidationError as exc:
        raise ValueError(f"{path}: {exc}") from None


def load_measured(path: Path = MEASURED) -> Measured:
    """The measured-inputs file."""
    return load_model(Measured, path)


def load_prices(pricing: Path = ROUTER_PRICING, plan: Path = PLAN_PRICES) -> Prices:
    """The router's pricing file and the planner's price table."""
    return Prices(load_pricing(pricing), load_model(PlanPrices, plan))
