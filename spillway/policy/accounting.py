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

**Reading them back.** ``route_events`` turns the lines into ``RouteEvent``s (anything
else on the lines is skipped) and ``RouteTotals`` sums them per route or backend: the one
sum behind ``spillway cost report``, the dashboard and the tuner's recorded figures, so
they agree to the digit.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

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


# --- reading the lines back ---------------------------------------------------------


def _values(value: object) -> list[float]:
    items = value if isinstance(value, list) else [value]
    return [float(v) for v in items if isinstance(v, int | float) and not isinstance(v, bool)]


def _is_route_document(document: object) -> bool:
    if not isinstance(document, dict):
        return False
    directives = document.get("_aws", {}).get("CloudWatchMetrics", [])
    return (
        any(isinstance(d, dict) and d.get("Namespace") == NAMESPACE for d in directives)
        and isinstance(document.get("rule"), str)
        and isinstance(document.get("backend"), str)
    )


def route_document(line: str) -> dict[str, Any] | None:
    """The router's EMF document of one request on ``line``, or ``None`` for any other
    line (plain logs, other namespaces, broken JSON)."""
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        document = json.loads(text)
    except ValueError:
        return None
    return document if _is_route_document(document) else None


@dataclass(frozen=True)
class RouteEvent:
    """One request as the router's metric line records it."""

    at: float
    """Seconds since the epoch (the EMF timestamp)."""
    rule: str
    backend: str
    model: str
    requests: int
    errors: int
    fallbacks: int
    spills: int
    cost_usd: float
    latencies_ms: tuple[float, ...]

    @classmethod
    def of(cls, document: dict[str, Any]) -> RouteEvent:
        """The event of a document ``route_document`` accepted."""
        stamp = document.get("_aws", {}).get("Timestamp", 0)
        return cls(
            at=float(stamp) / 1000 if isinstance(stamp, int | float) else 0.0,
            rule=document["rule"],
            backend=document["backend"],
            model=str(document.get("model", "-")),
            requests=int(sum(_values(document.get("Requests", 0)))),
            errors=int(sum(_values(document.get("Errors", 0)))),
            fallbacks=int(sum(_values(document.get("Fallbacks", 0)))),
            spills=int(sum(_values(document.get("Spills", 0)))),
            cost_usd=sum(_values(document.get("CostUSD", 0))),
            latencies_ms=tuple(_values(document.get("LatencyMs", []))),
        )


def route_events(lines: Iterable[str]) -> Iterator[RouteEvent]:
    """The request events among ``lines``, in order."""
    for line in lines:
        document = route_document(line)
        if document is not None:
            yield RouteEvent.of(document)


def nearest_rank(values: Iterable[float], quantile: float) -> float:
    """The nearest-rank ``quantile`` of ``values`` (0 when there are none)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(quantile * len(ordered)) - 1))]


@dataclass
class RouteTotals:
    """Sums of request events: one route's (rule, backend), one backend's, or all of them.
    Latencies are kept as they come; ``keeping(n)`` keeps only the last ``n``."""

    requests: int = 0
    errors: int = 0
    fallbacks: int = 0
    spills: int = 0
    cost_usd: float = 0.0
    latencies_ms: deque[float] = field(default_factory=deque)

    @classmethod
    def keeping(cls, keep: int) -> RouteTotals:
        """Totals that keep the latencies of the last ``keep`` requests only."""
        return cls(latencies_ms=deque(maxlen=keep))

    def add(self, event: RouteEvent) -> None:
        """Count one request event."""
        self.requests += event.requests
        self.errors += event.errors
        self.fallbacks += event.fallbacks
        self.spills += event.spills
        self.cost_usd += event.cost_usd
        self.latencies_ms.extend(event.latencies_ms)

    @property
    def usd_per_1k(self) -> float:
        """Average cost of a thousand requests."""
        return self.cost_usd / self.requests * 1000 if self.requests else 0.0

    @property
    def error_rate(self) -> float:
        """Share of the requests that failed (5xx)."""
        return self.errors / self.requests if self.requests else 0.0

    def latency_ms(self, quantile: float) -> float:
        """A latency quantile (nearest rank), 0 when there are none."""
        return nearest_rank(self.latencies_ms, quantile)


def combined(parts: Iterable[RouteTotals]) -> RouteTotals:
    """One total of several (their counts and cost; latencies are not pooled)."""
    total = RouteTotals()
    for part in parts:
        total.requests += part.requests
        total.errors += part.errors
        total.fallbacks += part.fallbacks
        total.spills += part.spills
        total.cost_usd += part.cost_usd
    return total
