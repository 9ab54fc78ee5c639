"""The span recorder the async-trace tests share: tracing set up for one test with an
in-memory exporter and taken down after it (``spillway.tracing.configure`` with an
exporter replaces whatever was set up); and two clients' trace carriers, one per
tenant."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spillway import tracing

TRACE_A, PARENT_A = "a1" * 16, "a2" * 8
TRACE_B, PARENT_B = "b1" * 16, "b2" * 8
CLIENT_A = {"traceparent": f"00-{TRACE_A}-{PARENT_A}-01", "tracestate": "vendor=a"}
CLIENT_B = {"traceparent": f"00-{TRACE_B}-{PARENT_B}-01"}
"""What two tenants' clients send (``alice``: with a ``tracestate``, ``bob``: without)."""


class Spans:
    """The finished spans, read after the batching processor has sent them."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        self.exporter = exporter

    def all(self) -> list[ReadableSpan]:
        tracing.flush()
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.all() if s.name == name]


def attrs(span: ReadableSpan) -> Mapping[str, Any]:
    """A span's attributes (none: empty)."""
    return span.attributes or {}


def hex_ids(span: ReadableSpan) -> tuple[str, str, str | None]:
    """(trace id, span id, parent span id) as 32 / 16 hex digits."""
    context = span.get_span_context()
    assert context is not None
    parent = f"{span.parent.span_id:016x}" if span.parent is not None else None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}", parent


@pytest.fixture(name="spans")
def spans_fixture() -> Iterator[Spans]:
    """Tracing on for the test (every span exported as it ends), and the spans finished
    during it; off again after, as for every other test."""
    exporter = InMemorySpanExporter()
    tracing.configure("test", exporter=exporter)
    yield Spans(exporter)
    tracing.shutdown()


@pytest.fixture(name="tracing_off")
def tracing_off_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that records no spans (as without an OTLP endpoint), for the test only:
    the module's tracer is set aside, whatever configured it, and put back after."""
    monkeypatch.setattr(tracing, "_tracer", None)
    monkeypatch.setattr(tracing, "_otel", None)
    assert not tracing.enabled()
