"""The local trace store behind ``spillway up``'s trace view, and a client helper.

``TraceStore`` keeps the spans the stack's processes export (``trace_server`` decodes
them) in memory, bounded three ways: at most ``max_traces`` traces, evicted least
recently updated first; at most ``max_spans`` spans in all (whole traces go, oldest
update first); at most ``max_spans_per_trace`` spans in one trace (later ones are counted
as dropped). A span sent twice (an exporter that retried) is kept once, by its span id.
One lock guards it all: the receiver's request threads add while the view's read.

``wait_for_trace`` polls a running receiver's ``/api/traces/{id}`` until a trace holds
enough spans, within a deadline (tests: the stack's processes export in batches).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

TENANT_ATTRIBUTE = "spillway.tenant"
"""The span attribute naming the tenant a request was served as (the ``tenant`` filter)."""
MAX_LIMIT = 1000
"""The most traces one ``/api/traces`` answer lists."""


@dataclass(frozen=True)
class SpanRecord:
    """One span as the view shows it: ids as lowercase hex, times in Unix nanoseconds,
    attributes as plain JSON values, ``kind`` and ``status`` as lowercase words."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service: str
    kind: str = "internal"
    start_ns: int = 0
    end_ns: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    """``{"name", "time_ns", "attributes"}`` each."""
    links: list[dict[str, Any]] = field(default_factory=list)
    """``{"trace_id", "span_id", "attributes"}`` each."""
    status: str = "unset"
    status_message: str = ""
    scope: str = ""
    """The instrumentation scope (tracer) that made it."""

    @property
    def duration_ms(self) -> float:
        """End minus start, in milliseconds (never negative)."""
        return max(0, self.end_ns - self.start_ns) / 1e6

    def to_json(self) -> dict[str, Any]:
        """The span as ``/api/traces/{id}`` lists it."""
        return {
            "span_id": self.span_id,
            "parent_span_id": self.parent_span_id,
            "name": self.name,
            "service": self.service,
            "kind": self.kind,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "duration_ms": round(self.duration_ms, 3),
            "attributes": self.attributes,
            "events": self.events,
            "links": self.links,
            "status": {"code": self.status, "message": self.status_message},
            "scope": self.scope,
        }


@dataclass(frozen=True)
class TraceQuery:
    """What ``/api/traces`` asks: every filter given must hold."""

    service: str | None = None
    """A span of this ``service.name`` is in the trace."""
    name: str | None = None
    """A span whose name contains this (case-insensitive) is in the trace."""
    min_ms: float = 0.0
    """The trace lasted at least this long."""
    tenant: str | None = None
    """A span of the trace was served as this tenant (``TENANT_ATTRIBUTE``)."""
    limit: int = 50
    """The most traces listed, newest start first."""


class _Trace:
    """The spans of one trace, by span id, with what its summary needs kept up to date."""

    def __init__(self, trace_id: str) -> None:
        self.trace_id = trace_id
        self.spans: dict[str, SpanRecord] = {}
        self.dropped = 0

    def add(self, span: SpanRecord, cap: int) -> int:
        """Keep ``span`` (replacing a resent one); the change in the number held."""
        if span.span_id in self.spans:
            self.spans[span.span_id] = span
            return 0
        if len(self.spans) >= cap:
            self.dropped += 1
            return 0
        self.spans[span.span_id] = span
        return 1

    def root(self) -> SpanRecord:
        """The earliest span without a parent here (a parent not received counts as
        none: the view still shows the part it has)."""
        spans = list(self.spans.values())
        roots = [s for s in spans if s.parent_span_id is None]
        orphans = roots or [s for s in spans if s.parent_span_id not in self.spans] or spans
        return min(orphans, key=lambda s: (s.start_ns, s.span_id))

    def summary(self) -> dict[str, Any]:
        """The trace as ``/api/traces`` lists it."""
        spans = self.spans.values()
        start = min(s.start_ns for s in spans)
        end = max(s.end_ns for s in spans)
        root = self.root()
        return {
            "trace_id": self.trace_id,
            "root": root.name,
            "root_service": root.service,
            "services": sorted({s.service for s in spans}),
            "start_ns": start,
            "duration_ms": round(max(0, end - start) / 1e6, 3),
            "span_count": len(self.spans),
            "dropped_spans": self.dropped,
            "error": any(s.status == "error" for s in spans),
        }

    def matches(self, query: TraceQuery, summary: dict[str, Any]) -> bool:
        """Whether every filter of ``query`` holds."""
        spans = self.spans.values()
        if query.service is not None and query.service not in summary["services"]:
            return False
        if summary["duration_ms"] < query.min_ms:
            return False
        if query.name is not None:
            wanted = query.name.lower()
            if not any(wanted in s.name.lower() for s in spans):
                return False
        if query.tenant is not None:
            return any(s.attributes.get(TENANT_ATTRIBUTE) == query.tenant for s in spans)
        return True


class TraceStore:
    """The last traces received, bounded, safe to use from many threads."""

    def __init__(
        self, max_traces: int = 2000, max_spans: int = 200_000, max_spans_per_trace: int = 2000
    ) -> None:
        if min(max_traces, max_spans, max_spans_per_trace) < 1:
            raise ValueError("the trace store's bounds must be at least 1")
        if max_spans_per_trace > max_spans:
            raise ValueError("max_spans_per_trace must not exceed max_spans")
        self.max_traces = max_traces
        self.max_spans = max_spans
        self.max_spans_per_trace = max_spans_per_trace
        self._traces: OrderedDict[str, _Trace] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def add(self, spans: list[SpanRecord]) -> int:
        """Keep ``spans``; how many were new. The traces they touch become the most
        recently updated; the least recently updated go while a bound is exceeded."""
        added = 0
        with self._lock:
            for span in spans:
                trace = self._traces.get(span.trace_id)
                if trace is None:
                    trace = self._traces[span.trace_id] = _Trace(span.trace_id)
                self._traces.move_to_end(span.trace_id)
                grew = trace.add(span, self.max_spans_per_trace)
                self._held += grew
                added += grew
                self._evict()
        return added

    def _evict(self) -> None:
        """Drop the least recently updated traces while a bound is exceeded (the one
        just updated is last, and alone it never exceeds ``max_spans``)."""
        while len(self._traces) > self.max_traces or self._held > self.max_spans:
            _, gone = self._traces.popitem(last=False)
            self._held -= len(gone.spans)

    def summaries(self, query: TraceQuery | None = None) -> list[dict[str, Any]]:
        """The traces ``query`` matches, newest start first, at most ``query.limit``."""
        query = query or TraceQuery()
        with self._lock:
            found = []
            for trace in self._traces.values():
                summary = trace.summary()
                if trace.matches(query, summary):
                    found.append(summary)
        found.sort(key=lambda s: (s["start_ns"], s["trace_id"]), reverse=True)
        return found[: query.limit]

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        """Every span of one trace, earliest start first, with its summary; ``None``
        when none is held."""
        with self._lock:
            trace = self._traces.get(trace_id.lower())
            if trace is None:
                return None
            summary = trace.summary()
            spans = sorted(trace.spans.values(), key=lambda s: (s.start_ns, s.span_id))
        return {**summary, "spans": [s.to_json() for s in spans]}

    def counts(self) -> tuple[int, int]:
        """``(traces, spans)`` held now."""
        with self._lock:
            return len(self._traces), self._held


def wait_for_trace(
    base_url: str,
    trace_id: str,
    *,
    spans_at_least: int = 1,
    timeout_s: float = 30.0,
    poll_s: float = 0.2,
) -> dict[str, Any]:
    """Poll ``{base_url}/api/traces/{trace_id}`` until the trace holds ``spans_at_least``
    spans; its JSON. ``TimeoutError`` (saying how many it last had) past ``timeout_s``."""
    url = f"{base_url.rstrip('/')}/api/traces/{trace_id}"
    deadline = time.monotonic() + timeout_s
    seen = 0
    while True:
        found = _get_json(url, max(0.5, deadline - time.monotonic()))
        if found is not None:
            seen = len(found["spans"])
            if seen >= spans_at_least:
                return found
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"trace {trace_id} held {seen} span(s), not {spans_at_least}, "
                f"after {timeout_s:.0f} s at {url}"
            )
        time.sleep(poll_s)


def _get_json(url: str, timeout_s: float) -> dict[str, Any] | None:
    """The JSON at ``url``; ``None`` on 404 (not received yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:  # noqa: S310 - a test's receiver
            found: dict[str, Any] = json.loads(answer.read())
            return found
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
