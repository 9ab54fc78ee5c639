"""Per-request metrics in CloudWatch's Embedded Metric Format (namespace ``Spillway``).

One EMF line per request, built with Powertools' ``EphemeralMetrics`` (no state shared
between requests or threads), with the dimensions rule, backend and model: CloudWatch
turns them into metrics; ``spillway cost report`` reads the same lines back. On Lambda
the lines go to stdout (CloudWatch Logs); locally they may go to a file.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from aws_lambda_powertools.metrics import EphemeralMetrics, MetricUnit

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
