"""One trace per request: the W3C carrier, the router's spans and the batcher's.

The spans are recorded by the real OpenTelemetry SDK into an in-memory exporter (the
``spans`` fixture sets tracing up for one test and takes it down after, so every other
test runs with tracing off, as a deployment without an OTLP endpoint does).
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gpu_service.batcher import DynamicBatcher
from gpu_service.batching_policy import BatchingPolicy
from spillway import tracing
from spillway.models.processing import Tensors
from spillway.policy.backend import Backend, BackendRequest, BackendResponse
from spillway.policy.facts import Call
from spillway.protocol.errors import SpillwayError
from spillway.protocol.wire import Target
from spillway.router.batch_mode import BatchBackend
from spillway.router.dispatch import Router
from spillway.router.routed import Routed
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from tests.fakes import InlineExecutor, SummingRunner, fake_request, row_sums
from tests.unit.router_support import fake_overrides

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
BODY = b'{"inputs":[{"name":"x","shape":[1,1],"datatype":"FP32","data":[1.0]}]}'


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure("spillway-test", exporter=exporter)
    yield exporter
    tracing.shutdown()


class Scripted:
    """A backend answering with a fixed status, noting each request's headers."""

    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.name = "scripted"
        self.status = status
        self.headers = headers or {}
        self.sent: list[BackendRequest] = []
        self.current_trace: list[str | None] = []

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        self.sent.append(request)
        self.current_trace.append(tracing.trace_id())
        body = b'{"outputs":[]}' if self.status == 200 else b'{"error":"x","code":"y"}'
        return BackendResponse(self.status, dict(self.headers), body, 0.001)


def _router(gpu: Backend, cpu: Backend, watched: list[Routed] | None = None) -> Router:
    settings = RouterSettings(gpu_url="http://gpu", trust_tenant_hints=True)
    backends: dict[str, Backend] = {"gpu": gpu, "cpu": cpu, "batch": BatchBackend(None)}
    overrides = fake_overrides(backends, lambda: 100.0, io.StringIO())
    app = create_app(settings, overrides)
    if watched is not None:
        app.router.watch = watched.append
    return app.router


def _call(headers: dict[str, str]) -> tuple[Call, Target]:
    call = Call("POST", {"content-type": "application/json", **headers}, BODY, "req-1")
    return call, Target("infer", "digits")


def by_name(finished: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


# --- the carrier --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "",
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",  # all-zero trace id
        f"00-{CLIENT_TRACE}-" + "0" * 16 + "-01",  # all-zero parent
        f"00-{CLIENT_TRACE}-{CLIENT_PARENT}",  # no flags
        f"00-{CLIENT_TRACE[:-1]}-{CLIENT_PARENT}-01",  # short id
        f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01; drop table",
    ],
)
def test_a_malformed_traceparent_is_ignored(value: str) -> None:
    assert tracing.parse_traceparent(value) is None
    assert tracing.carrier_of({"traceparent": value, "tracestate": "a=b"}) == {}


def test_the_carrier_keeps_only_a_valid_parent_and_a_bounded_state() -> None:
    assert tracing.parse_traceparent(TRACEPARENT) == (CLIENT_TRACE, CLIENT_PARENT, True)
    carrier = tracing.carrier_of({"traceparent": TRACEPARENT, "tracestate": "k=v", "x": "y"})
    assert carrier == {"traceparent": TRACEPARENT, "tracestate": "k=v"}
    huge = tracing.carrier_of({"traceparent": TRACEPARENT, "tracestate": "k=" + "v" * 600})
    assert huge == {"traceparent": TRACEPARENT}
    assert tracing.carrier_of({"traceparent": 7}) == {}
    raw = [(b"traceparent", TRACEPARENT.encode()), (b"host", b"x")]
    assert tracing.carrier_of_pairs(raw) == {"traceparent": TRACEPARENT}


def test_with_tracing_off_the_clients_trace_still_travels_on() -> None:
    assert not tracing.enabled()
    gpu = Scripted(200)
    router = _router(gpu, Scripted(200))
    call, target = _call({"traceparent": TRACEPARENT, "tracestate": "k=v"})
    assert router.route(call, target).status == 200
    # THEN the backend is sent the client's carrier unchanged, and sees its trace id
    assert gpu.sent[0].headers["traceparent"] == TRACEPARENT
    assert gpu.sent[0].headers["tracestate"] == "k=v"
    assert gpu.current_trace == [CLIENT_TRACE]
    assert tracing.span("x") is tracing.NO_SPAN
    # AND a request without one sends none
    router.route(*_call({}))
    assert "traceparent" not in gpu.sent[1].headers


def test_the_environment_decides_whether_to_trace() -> None:
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/t"})
    off = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}
    assert not tracing.wanted(off)
    assert not tracing.configure("x", environ={})
    assert not tracing.enabled()


# --- the router's spans -------------------------------------------------------------------


def test_a_fallback_is_one_trace_of_route_decide_and_two_attempts(
    spans: InMemorySpanExporter,
) -> None:
    # GIVEN a GPU backend that fails with its own fault and a CPU backend that serves
    gpu, cpu = Scripted(503, {"x-spillway-fault": "server"}), Scripted(200)
    watched: list[Routed] = []
    router = _router(gpu, cpu, watched)
    # WHEN a client's traced request is routed
    reply = router.route(*_call({"traceparent": TRACEPARENT}))
    assert reply.status == 200
    assert reply.header("x-spillway-fallback") == "gpu:unavailable"
    finished = spans.get_finished_spans()
    # THEN every span is in the client's trace
    assert {f"{s.context.trace_id:032x}" for s in finished} == {CLIENT_TRACE}
    [route] = by_name(finished, "spillway.route")
    [decide] = by_name(finished, "spillway.decide")
    first, second = by_name(finished, "spillway.attempt")
    assert route.kind is SpanKind.SERVER
    assert route.parent is not None
    assert f"{route.parent.span_id:016x}" == CLIENT_PARENT
    assert decide.parent is not None
    assert decide.parent.span_id == route.context.span_id
    assert route.attributes is not None
    assert route.attributes["spillway.backend"] == "cpu"
    assert route.attributes["spillway.fallback"] == "gpu:unavailable"
    assert route.attributes["http.response.status_code"] == 200
    assert route.attributes["spillway.attempts"] == ("gpu:unavailable", "cpu:status_200")
    # AND each attempt is a client span of the route, the GPU one failed, the CPU one
    # says what it fell back from
    for attempt in (first, second):
        assert attempt.kind is SpanKind.CLIENT
        assert attempt.parent is not None
        assert attempt.parent.span_id == route.context.span_id
    assert first.attributes is not None
    assert second.attributes is not None
    assert first.attributes["spillway.backend"] == "gpu"
    assert first.status.status_code is StatusCode.ERROR
    assert second.attributes["spillway.backend"] == "cpu"
    assert second.attributes["spillway.fallback_from"] == "gpu:unavailable"
    assert second.status.status_code is not StatusCode.ERROR
    # AND each backend was sent its own attempt's span as the parent
    for backend, attempt in ((gpu, first), (cpu, second)):
        parsed = tracing.parse_traceparent(backend.sent[0].headers["traceparent"])
        assert parsed == (CLIENT_TRACE, f"{attempt.context.span_id:016x}", True)
    # AND the watcher was told the trace id
    [seen] = watched
    assert (seen.trace_id, seen.backend, seen.reply.status) == (CLIENT_TRACE, "cpu", 200)


def test_a_request_without_a_trace_starts_one(spans: InMemorySpanExporter) -> None:
    gpu = Scripted(200)
    _router(gpu, Scripted(200)).route(*_call({}))
    [route] = by_name(spans.get_finished_spans(), "spillway.route")
    assert route.parent is None
    parsed = tracing.parse_traceparent(gpu.sent[0].headers["traceparent"])
    assert parsed is not None
    assert parsed[0] == f"{route.context.trace_id:032x}"


def test_a_refused_request_is_an_error_span_and_is_watched(spans: InMemorySpanExporter) -> None:
    watched: list[Routed] = []
    router = _router(Scripted(200), Scripted(200), watched)
    call, target = _call({"traceparent": TRACEPARENT})
    bad = type(call)(call.method, call.headers, b"{not json", call.request_id)
    with pytest.raises(SpillwayError) as refused:
        router.route(bad, target)
    [route] = by_name(spans.get_finished_spans(), "spillway.route")
    assert route.status.status_code is StatusCode.ERROR
    [seen] = watched
    assert seen.reply.status == refused.value.status == 400
    assert seen.trace_id == CLIENT_TRACE
    assert seen.request is None


def test_sampling_at_zero_records_nothing_but_still_passes_the_trace_on() -> None:
    exporter = InMemorySpanExporter()
    environ = {"SPILLWAY_TRACE_SAMPLE": "0"}
    tracing.configure("spillway-test", environ=environ, exporter=exporter)
    try:
        gpu = Scripted(200)
        _router(gpu, Scripted(200)).route(*_call({}))
        assert exporter.get_finished_spans() == ()
        parsed = tracing.parse_traceparent(gpu.sent[0].headers["traceparent"])
        assert parsed is not None
        assert parsed[2] is False
    finally:
        tracing.shutdown()
    with pytest.raises(ValueError, match="between 0 and 1"):
        tracing.configure("x", environ={"SPILLWAY_TRACE_SAMPLE": "2"}, exporter=exporter)


# --- the batcher's spans ------------------------------------------------------------------


def test_one_batch_span_links_every_request_it_carried(spans: InMemorySpanExporter) -> None:
    # A batch forms when full (3), long before its 10 s delay: the three run together.
    policy = BatchingPolicy(max_batch_size=3, max_queue_delay_s=10.0)
    runner = SummingRunner()

    async def main() -> list[float]:
        batcher = DynamicBatcher("summer", runner, policy, InlineExecutor())
        batcher.start()

        async def one(ident: int) -> float:
            with tracing.span(f"request-{ident}"):
                result = await batcher.submit(fake_request(ident))
            return row_sums_of(result)

        sums = await asyncio.gather(*(one(i) for i in range(3)))
        await batcher.stop(1.0)
        return list(sums)

    sums = asyncio.run(main())
    assert sums == [float(row_sums(fake_request(i))[0, 0]) for i in range(3)]
    assert runner.batches == [[0, 1, 2]]
    finished = spans.get_finished_spans()
    requests = {s.name: s for s in finished if s.name.startswith("request-")}
    [batch] = by_name(finished, "spillway.batch")
    linked = {link.context.span_id for link in batch.links}
    assert linked == {s.context.span_id for s in requests.values()}
    # The batch is a child of its first request, so that request's trace shows it.
    assert batch.parent is not None
    assert batch.parent.span_id in linked
    assert batch.attributes is not None
    assert batch.attributes["spillway.batch.requests"] == 3
    assert batch.attributes["spillway.model"] == "summer"


def row_sums_of(result: Tensors) -> float:
    [value] = result.values()
    return float(value[0, 0])


def test_a_batch_shows_under_its_recorded_request_and_unsampled_work_costs_no_spans(
    spans: InMemorySpanExporter,
) -> None:
    # GIVEN two requests batched together, one whose client's trace is sampled, one not
    policy = BatchingPolicy(max_batch_size=2, max_queue_delay_s=10.0)
    unsampled = f"00-{'c' * 32}-{'d' * 16}-00"

    async def main() -> None:
        batcher = DynamicBatcher("summer", SummingRunner(), policy, InlineExecutor())
        batcher.start()

        async def one(ident: int, traceparent: str) -> None:
            with tracing.carry({"traceparent": traceparent}), tracing.span(f"request-{ident}"):
                await batcher.submit(fake_request(ident))

        await asyncio.gather(one(0, unsampled), one(1, TRACEPARENT))
        await batcher.stop(1.0)

    asyncio.run(main())
    finished = spans.get_finished_spans()
    # THEN the unsampled request made no span at all, the sampled one its own
    assert sorted(s.name for s in finished) == ["request-1", "spillway.batch"]
    [request] = by_name(finished, "request-1")
    [batch] = by_name(finished, "spillway.batch")
    # AND the batch sits under the recorded request, linked to both
    assert batch.parent is not None
    assert batch.parent.span_id == request.context.span_id
    assert len(batch.links) == 2
    assert {f"{link.context.trace_id:032x}" for link in batch.links} == {"c" * 32, CLIENT_TRACE}
