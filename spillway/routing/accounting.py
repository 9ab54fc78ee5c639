"""Accounting: what a request cost, and the one metrics line that records it.

**Cost.**

* Lambda (the router itself and the CPU fallback): billed duration rounded up to the
  millisecond × memory in GB × price per GB-second, plus the price per request. Every
  invocation is billed, failed ones too.
* GPU service and AWS Batch: the instance's price per hour spread over its measured
  throughput (inferences, i.e. rows, per second) × the request's rows. Capacity is paid
  whether or not it is used, so this is the marginal share of a busy instance.

The defaults are us-east-1 on-demand list prices (x86 Lambda; a g5.xlarge for the GPU
service and the Batch compute environment); put the figures of your region and your
measured throughput in a pricing file (``config/pricing.yaml``).

**Metrics.** One line per request in CloudWatch's Embedded Metric Format (namespace
``Spillway``), built with Powertools' ``EphemeralMetrics`` (no state shared between
requests or threads), with the dimensions rule, backend and model: CloudWatch turns them
into metrics; ``spillway cost report`` reads the same lines back. On Lambda the lines go
to stdout (CloudWatch Logs); locally they may go to a file.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from aws_lambda_powertools.metrics import EphemeralMetrics, MetricUnit
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LambdaPrice(_Strict):
    """A Lambda function's price: per GB-second of billed duration and per request."""

    usd_per_gb_second: float = Field(default=0.0000166667, ge=0)
    usd_per_request: float = Field(default=0.0000002, ge=0)
    memory_mb: int = Field(default=512, ge=128, le=10240)

    def cost(self, duration_s: float) -> float:
        """The bill of one invocation that ran ``duration_s`` seconds."""
        billed_ms = math.ceil(max(duration_s, 0.0) * 1000)
        return billed_ms / 1000 * self.memory_mb / 1024 * self.usd_per_gb_second + (
            self.usd_per_request
        )


class CapacityPrice(_Strict):
    """Provisioned capacity: its price per hour and its measured throughput."""

    usd_per_hour: float = Field(ge=0)
    inferences_per_second: float = Field(gt=0)

    def cost(self, rows: int) -> float:
        """The share of an hour of capacity that ``rows`` inferences use."""
        return self.usd_per_hour / 3600 / self.inferences_per_second * max(rows, 1)


class Pricing(_Strict):
    """Prices of every route."""

    router: LambdaPrice = Field(default_factory=lambda: LambdaPrice(memory_mb=512))
    cpu: LambdaPrice = Field(default_factory=lambda: LambdaPrice(memory_mb=3008))
    gpu: CapacityPrice = Field(
        default_factory=lambda: CapacityPrice(usd_per_hour=1.006, inferences_per_second=400)
    )
    batch: CapacityPrice = Field(
        default_factory=lambda: CapacityPrice(usd_per_hour=1.006, inferences_per_second=2000)
    )

    def attempt(self, backend: str, *, rows: int, billed_s: float, served: bool) -> float:
        """The cost of one attempt on ``backend`` (failed Lambda calls are billed too)."""
        if backend == "cpu":
            return self.cpu.cost(billed_s)
        if not served:
            return 0.0
        if backend == "gpu":
            return self.gpu.cost(rows)
        if backend == "batch":
            return self.batch.cost(rows)
        return 0.0


def load_pricing(path: Path | None) -> Pricing:
    """The pricing in ``path`` (YAML or JSON), or the defaults when ``path`` is ``None``."""
    if path is None:
        return Pricing()
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
        return Pricing.model_validate(data or {})
    except (ValueError, ValidationError) as exc:
        raise ValueError(f"{path}: invalid pricing: {exc}") from None


# --- metrics ----------------------------------------------------------------------

NAMESPACE = "Spillway"
SERVICE = "spillway-router"


@dataclass(frozen=True)
class RouteRecord:
    """What one request did, for metrics and the cost report."""

    rule: str
    backend: str
    model: str | None
    status: int
    latency_ms: float
    cost_usd: float
    fallback: bool = False
    spilled: bool = False
    attempts: int = 1


class EmfSink:
    """Writes one EMF line per record to a stream (stdout by default) or a file."""

    def __init__(self, path: Path | None = None, stream: TextIO | None = None) -> None:
        self._path = path
        self._stream = stream
        self._lock = threading.Lock()

    def emit(self, record: RouteRecord) -> None:
        """Serialise the record as EMF and write it as one line."""
        self.write(route_metrics(record))

    def write(self, document: dict[str, object]) -> None:
        """Write one EMF document as a line."""
        line = json.dumps(document, separators=(",", ":")) + "\n"
        with self._lock:
            if self._path is not None:
                with self._path.open("a", encoding="utf-8") as handle:
                    handle.write(line)
            else:
                stream = self._stream or sys.stdout
                stream.write(line)
                stream.flush()


def route_metrics(record: RouteRecord) -> dict[str, object]:
    """The EMF document of one request."""
    metrics = EphemeralMetrics(namespace=NAMESPACE, service=SERVICE)
    metrics.add_dimension("rule", record.rule)
    metrics.add_dimension("backend", record.backend)
    metrics.add_dimension("model", record.model or "-")
    metrics.add_metric("Requests", MetricUnit.Count, 1)
    metrics.add_metric("CostUSD", MetricUnit.NoUnit, record.cost_usd)
    metrics.add_metric("LatencyMs", MetricUnit.Milliseconds, record.latency_ms)
    metrics.add_metric("Fallbacks", MetricUnit.Count, int(record.fallback))
    metrics.add_metric("Spills", MetricUnit.Count, int(record.spilled))
    metrics.add_metric("Errors", MetricUnit.Count, int(record.status >= 500))
    document: dict[str, object] = dict(metrics.serialize_metric_set())
    document["status"] = record.status
    document["attempts"] = record.attempts
    return document


def event_metric(name: str) -> dict[str, object]:
    """A single count (e.g. ``PolicyRejected``) with only the service dimension."""
    metrics = EphemeralMetrics(namespace=NAMESPACE, service=SERVICE)
    metrics.add_metric(name, MetricUnit.Count, 1)
    return dict(metrics.serialize_metric_set())
