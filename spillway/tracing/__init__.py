"""One trace per request across every tier: W3C Trace Context and OpenTelemetry spans.

Every tier (router, GPU service, CPU fallback, async workers, batch jobs) calls
``configure(service)`` once at start. Tracing is on when an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) and
``OTEL_SDK_DISABLED`` is not ``true``: spans then go, batched, to that endpoint over
OTLP/HTTP (on AWS the ADOT collector beside the ECS task and the ADOT Lambda layer's
extension, both forwarding to X-Ray; locally ``spillway up``'s receiver). Which requests
are recorded is OpenTelemetry's own sampler setting (``OTEL_TRACES_SAMPLER``,
``OTEL_TRACES_SAMPLER_ARG``; Spillway's default is ``parentbased_traceidratio`` at
``SPILLWAY_TRACE_SAMPLE`` when that is set): a sampled client's ``traceparent`` is
followed, and an unsampled request costs one random draw.

With tracing off nothing of OpenTelemetry is imported: ``span`` returns a shared no-op,
and a client's ``traceparent`` still travels on unchanged (``carry``/``inject``), so the
tiers behind a router that does not trace can.

The carrier is the same everywhere: a ``traceparent`` (and ``tracestate``) header on HTTP,
gRPC metadata of those names, and a ``trace`` object of those keys in the JSON the async
records, Step Functions inputs and batch job parameters hold
(https://www.w3.org/TR/trace-context/).
"""

from __future__ import annotations

import contextvars
import os
import re
from collections.abc import Iterable, Mapping, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, SpanContext, Tracer

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
CARRIER_KEYS = (TRACEPARENT, TRACESTATE)
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_SAMPLE_ENV = "SPILLWAY_TRACE_SAMPLE"

_tracer: Tracer | None = None
_provider: TracerProvider | None = None
_passing: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "spillway_trace_carrier", default=None
)
"""With tracing off: the carrier a request came with, passed on as it came."""


def enabled() -> bool:
    """Whether this process records spans."""
    return _otel is not None


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for tracing (an OTLP endpoint, the SDK not disabled,
    no ``OTEL_TRACES_EXPORTER=none``)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def configure(
    service: str,
    *,
    environ: Mapping[str, str] = os.environ,
    exporter: SpanExporter | None = None,
) -> bool:
    """Set this process's tracing up once (a later call changes nothing) and return
    whether spans are recorded. ``exporter`` (tests) replaces whatever was set up with
    that exporter, every span exported as it ends."""
    global _tracer, _provider, _otel
    if exporter is not None:
        shutdown()
    elif _tracer is not None:
        return True
    elif not wanted(environ):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or service})
    provider = TracerProvider(resource=resource, sampler=_sampler(environ))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(_endpoint(environ))))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    # The provider is this module's own, not installed as OpenTelemetry's global one:
    # the context (which span is current) is what the tiers share, and a test can set
    # tracing up afresh.
    _provider = provider
    _tracer = provider.get_tracer("spillway")
    _otel = _Otel(_tracer)
    return True


def _endpoint(environ: Mapping[str, str]) -> str | None:
    """Where spans go, read from ``environ`` (not only the process's environment):
    the traces endpoint as given, else the base endpoint's ``/v1/traces``."""
    traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:
        return traces
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return f"{base.rstrip('/')}/v1/traces" if base else None


def _sampler(environ: Mapping[str, str]) -> Any:
    """OpenTelemetry's sampler from ``OTEL_TRACES_SAMPLER``; else, with
    ``SPILLWAY_TRACE_SAMPLE`` set, parent-based at that ratio; else parent-based always
    on (every request a router starts is recorded)."""
    from opentelemetry.sdk.trace import sampling

    if environ.get("OTEL_TRACES_SAMPLER"):
        return None  # the SDK reads OTEL_TRACES_SAMPLER and its argument itself
    share = environ.get(_SAMPLE_ENV)
    if share is None or not share.strip():
        return sampling.ParentBased(sampling.ALWAYS_ON)
    ratio = float(share)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{_SAMPLE_ENV} must be between 0 and 1, not {share}")
    return sampling.ParentBased(sampling.TraceIdRatioBased(ratio))


def flush(timeout_s: float = 2.0) -> None:
    """Send what is buffered (a Lambda function's invocation ends frozen: its spans go
    before it returns)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Flush and stop exporting (a process that ends)."""
    global _tracer, _provider, _otel
    if _provider is not None:
        _provider.shutdown()
    _tracer, _provider, _otel = None, None, None


# --- the carrier -------------------------------------------------------------------------


def parse_traceparent(value: str | None) -> tuple[str, str, bool] | None:
    """``(trace id, parent span id, sampled)`` of a well-formed version-00 header, else
    ``None`` (a malformed one is ignored, as the W3C recommendation says)."""
    if not value:
        return None
    found = _TRACEPARENT.match(value.strip().lower())
    if found is None or set(found[1]) == {"0"} or set(found[2]) == {"0"}:
        return None
    return found[1], found[2], bool(int(found[3], 16) & 1)


def carrier_of(source: Mapping[str, Any] | None) -> dict[str, str]:
    """The trace carrier in headers, gRPC metadata or a JSON ``trace`` object: only a
    well-formed ``traceparent`` and the ``tracestate`` beside it."""
    if not source:
        return {}
    parent = source.get(TRACEPARENT)
    if not isinstance(parent, str) or parse_traceparent(parent) is None:
        return {}
    carrier = {TRACEPARENT: parent.strip()}
    state = source.get(TRACESTATE)
    if isinstance(state, str) and 0 < len(state) <= 512:
        carrier[TRACESTATE] = state
    return carrier


def carrier_of_pairs(pairs: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """``carrier_of`` for raw header pairs (lower-case byte names, as HTTP servers keep
    them)."""
    found: dict[str, str] = {}
    for name, value in pairs:
        if name in (b"traceparent", b"tracestate"):
            found.setdefault(name.decode(), value.decode("latin-1"))
    return carrier_of(found)


def carry(source: Mapping[str, Any] | None) -> AbstractContextManager[None]:
    """Within the block, the request's trace is the one its carrier names (headers, gRPC
    metadata, a JSON ``trace`` object): spans started there are its children, and
    ``inject`` passes it on. No carrier: a shared no-op (every request's path calls it)."""
    carrier = carrier_of(source)
    return _Carried(carrier) if carrier else _NOTHING_CARRIED


class _Carried:
    """The block of ``carry`` with a carrier: attached as the current trace (or, with
    tracing off, kept to be passed on as it came)."""

    __slots__ = ("_attached", "_carrier", "_token")

    def __init__(self, carrier: dict[str, str]) -> None:
        self._carrier = carrier
        self._token: Any = None
        self._attached: _Otel | None = None

    def __enter__(self) -> None:
        otel = self._attached = _otel
        if otel is None:
            self._token = _passing.set(self._carrier)
        else:
            self._token = otel.context.attach(otel.propagator.extract(self._carrier))

    def __exit__(self, *exc: object) -> None:
        if self._attached is None:
            _passing.reset(self._token)
        else:
            self._attached.context.detach(self._token)


_NOTHING_CARRIED = nullcontext()


def inject(target: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Put the current trace's carrier into ``target`` (outgoing headers, metadata or a
    JSON ``trace`` object); nothing when there is none."""
    otel = _otel
    if otel is None:
        passing = _passing.get()
        if passing:
            target.update(passing)
        return target
    otel.propagator.inject(target)
    return target


def outgoing() -> dict[str, str]:
    """The current trace's carrier as a fresh dict (empty: no trace)."""
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier


def trace_id() -> str | None:
    """The current trace's id (32 hex digits), recorded or only passed on."""
    otel = _otel
    if otel is None:
        passing = _passing.get()
        parsed = parse_traceparent(passing.get(TRACEPARENT)) if passing else None
        return parsed[0] if parsed else None
    context = otel.trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else None


# --- spans ------------------------------------------------------------------------------


class _NoSpan:
    """The span of a request that is not recorded (tracing off, or its trace not
    sampled): every call does nothing, and the current trace stays as it was, so what
    is sent on still carries it (with its not-sampled flag)."""

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set(self, key: str, value: Any) -> None:
        """Ignored."""

    def event(self, name: str, **attributes: Any) -> None:
        """Ignored."""

    def fail(self, message: str) -> None:
        """Ignored."""

    @property
    def link(self) -> None:
        return None


NO_SPAN = _NoSpan()


class Traced:
    """A recorded span: attributes, events, an error status, and its end. As a context
    manager it is the current span within the block (and ends with it)."""

    __slots__ = ("_otel", "_span", "_token")

    def __init__(self, otel: _Otel, span: Span) -> None:
        self._otel = otel
        self._span = span
        self._token: object = None

    def __enter__(self) -> Traced:
        otel = self._otel
        self._token = otel.context.attach(otel.trace.set_span_in_context(self._span))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: Any
    ) -> None:
        otel = self._otel
        try:
            if error is not None:
                self._span.record_exception(error)
                self.fail(f"{kind.__name__ if kind else 'error'}: {error}")
        finally:
            otel.context.detach(self._token)
            self._span.end()

    def set(self, key: str, value: Any) -> None:
        """One attribute (``None`` is left out)."""
        if value is not None:
            self._span.set_attribute(key, value)

    def event(self, name: str, **attributes: Any) -> None:
        """A point in time within the span (a retry, a breaker's verdict)."""
        self._span.add_event(name, {k: v for k, v in attributes.items() if v is not None})

    def fail(self, message: str) -> None:
        """Mark the span as an error."""
        otel = self._otel
        self._span.set_status(otel.Status(otel.StatusCode.ERROR, message))

    @property
    def link(self) -> SpanContext:
        """What a later span links to (a batch to each request it carried)."""
        return self._span.get_span_context()


Span_ = _NoSpan | Traced


def span(
    name: str,
    *,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
    links: Iterable[SpanContext | None] = (),
    parent: SpanContext | None = None,
) -> Span_:
    """A span around a block (``with span(...) as s``), a child of ``parent`` (a ``link``
    taken earlier) or else of the current span; the block's spans and ``inject`` see it
    as current. Under a parent that is not sampled it is ``NO_SPAN`` at once: an
    unsampled request costs its root span alone."""
    otel = _otel
    if otel is None:
        return NO_SPAN
    started = _start(otel, name, kind, attributes, links, parent)
    return NO_SPAN if started is None else Traced(otel, started)


def record(
    name: str,
    start_ns: int,
    end_ns: int,
    *,
    attributes: Mapping[str, Any] | None = None,
    error: str | None = None,
) -> None:
    """A span that already happened (a request's wait in a queue, timed by whoever
    held it), a child of the current span; times are ``time.time_ns()`` readings."""
    otel = _otel
    if otel is None or _unsampled(otel, None):
        return
    done = otel.tracer.start_span(name, start_time=start_ns, attributes=_kept(attributes))
    if error is not None:
        done.set_status(otel.Status(otel.StatusCode.ERROR, error))
    done.end(end_time=max(start_ns, end_ns))


def recording() -> bool:
    """Whether a span started now would be recorded (tracing on, and the current trace,
    if any, sampled): what a caller asks before building a span's attributes."""
    otel = _otel
    return otel is not None and not _unsampled(otel, None)


def current_link() -> SpanContext | None:
    """The current span, to link to or start children of later (``None``: not traced)."""
    otel = _otel
    if otel is None:
        return None
    context = otel.trace.get_current_span().get_span_context()
    return context if context.is_valid else None


def sampled(links: Iterable[SpanContext | None]) -> SpanContext | None:
    """The first of ``links`` whose trace is recorded (``None``: none is): the parent a
    span shared by several requests (a batch) is shown under."""
    return next((c for c in links if c is not None and c.trace_flags.sampled), None)


def _unsampled(otel: _Otel, parent: SpanContext | None) -> bool:
    """Whether a new span would sit under a parent whose trace is not recorded."""
    context = parent or otel.trace.get_current_span().get_span_context()
    return context.is_valid and not context.trace_flags.sampled


def _kept(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (attributes or {}).items() if v is not None}


def _start(
    otel: _Otel,
    name: str,
    kind: str,
    attributes: Mapping[str, Any] | None,
    links: Iterable[SpanContext | None],
    parent: SpanContext | None,
) -> Span | None:
    """The span started (``None``: its parent's trace is not recorded, so neither is
    it: the parent-based samplers would say so after building it)."""
    if _unsampled(otel, parent):
        return None
    context: Context | None = None
    if parent is not None:
        context = otel.trace.set_span_in_context(otel.trace.NonRecordingSpan(parent))
    linked = [otel.Link(c) for c in links if c is not None and c.is_valid]
    return otel.tracer.start_span(
        name,
        context=context,
        kind=otel.kinds[kind],
        attributes=_kept(attributes),
        links=linked,
    )


class _Otel:
    """OpenTelemetry's parts, imported once when tracing is set up (never when off)."""

    def __init__(self, tracer: Tracer) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.context = context
        self.trace = trace
        self.propagator = TraceContextTextMapPropagator()
        self.Link = Link
        self.Status = Status
        self.StatusCode = StatusCode
        self.kinds = {k.name.lower(): k for k in SpanKind}


_otel: _Otel | None = None
