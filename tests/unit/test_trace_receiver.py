"""The local trace receiver: its store (bounds, order, parent and child, links, tenants)
and its HTTP side as a WSGI app (OTLP Protobuf, JSON and gzip in; the answers the OTLP
specification prescribes; the query API and the pages)."""

from __future__ import annotations

import gzip
import json
import threading
from typing import Any

import pytest
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span, Status
from werkzeug.test import Client, TestResponse

from spillway_cli.dashboard.trace_server import TraceApp, guarded
from spillway_cli.dashboard.traces import SpanRecord, TraceQuery, TraceStore

TRACE_A = "0af7651916cd43dd8448eb211c80319c"
TRACE_B = "4bf92f3577b34da6a3ce929d0e0e4736"
PROTOBUF = {"content-type": "application/x-protobuf"}


def record(trace: str, span: str, parent: str | None = None, **fields: Any) -> SpanRecord:
    """A span of ``trace`` with id ``span`` (16 hex digits, padded)."""
    fields.setdefault("name", f"op-{span}")
    fields.setdefault("service", "spillway-router")
    return SpanRecord(trace, span.rjust(16, "0"), parent and parent.rjust(16, "0"), **fields)


def attribute(key: str, value: str | int) -> KeyValue:
    wrapped = AnyValue(string_value=value) if isinstance(value, str) else AnyValue(int_value=value)
    return KeyValue(key=key, value=wrapped)


def export(service: str, *spans: Span) -> ExportTraceServiceRequest:
    """An export request of one resource (``service``) and one scope holding ``spans``."""
    resource = ResourceSpans()
    resource.resource.attributes.append(attribute("service.name", service))
    scope = resource.scope_spans.add()
    scope.scope.name = "spillway"
    scope.spans.extend(spans)
    return ExportTraceServiceRequest(resource_spans=[resource])


def proto_span(
    trace: str, span: str, parent: str = "", start: int = 1_000, end: int = 2_000, **kw: Any
) -> Span:
    return Span(
        trace_id=bytes.fromhex(trace),
        span_id=bytes.fromhex(span),
        parent_span_id=bytes.fromhex(parent),
        start_time_unix_nano=start,
        end_time_unix_nano=end,
        **kw,
    )


def json_of(answer: TestResponse) -> Any:
    """An answer's JSON body."""
    return json.loads(answer.data)


@pytest.fixture
def store() -> TraceStore:
    return TraceStore(max_traces=10, max_spans=100, max_spans_per_trace=20)


@pytest.fixture
def client(store: TraceStore) -> Client:
    return Client(guarded(TraceApp(store, max_body_bytes=64 * 1024)))


# --- the store --------------------------------------------------------------------------


def test_the_least_recently_updated_trace_goes_first_past_max_traces() -> None:
    # GIVEN a store of at most two traces, holding A then B, and A updated last
    store = TraceStore(max_traces=2, max_spans=100, max_spans_per_trace=10)
    store.add([record("a" * 32, "1")])
    store.add([record("b" * 32, "1")])
    store.add([record("a" * 32, "2", "1")])
    # WHEN a third trace arrives
    store.add([record("c" * 32, "1")])
    # THEN B (least recently updated) went, A and C stay
    assert store.trace("b" * 32) is None
    assert {s["trace_id"] for s in store.summaries()} == {"a" * 32, "c" * 32}
    assert store.counts() == (2, 3)


def test_whole_traces_go_while_more_spans_than_max_spans_are_held() -> None:
    # GIVEN a store of at most 5 spans, holding traces of 2 and 3 spans
    store = TraceStore(max_traces=10, max_spans=5, max_spans_per_trace=5)
    store.add([record("a" * 32, str(i)) for i in range(1, 3)])
    store.add([record("b" * 32, str(i)) for i in range(1, 4)])
    # WHEN one more span arrives
    store.add([record("c" * 32, "1")])
    # THEN the oldest trace went whole, and the count is what is held
    assert store.trace("a" * 32) is None
    assert store.counts() == (2, 4)


def test_spans_past_the_per_trace_cap_are_counted_as_dropped_and_resends_kept_once() -> None:
    store = TraceStore(max_traces=10, max_spans=100, max_spans_per_trace=3)
    # GIVEN a trace sent whole twice (an exporter that retried), then with two more spans
    spans = [record(TRACE_A, str(i)) for i in range(1, 4)]
    assert store.add(spans) == 3
    assert store.add(spans) == 0
    assert store.add([record(TRACE_A, "4"), record(TRACE_A, "5")]) == 0
    # THEN it holds its first three, and says two were dropped
    trace = store.trace(TRACE_A)
    assert trace is not None
    assert [s["span_id"] for s in trace["spans"]] == [str(i).rjust(16, "0") for i in (1, 2, 3)]
    assert (trace["span_count"], trace["dropped_spans"]) == (3, 2)


def test_traces_are_listed_newest_start_first_up_to_the_limit(store: TraceStore) -> None:
    for i, trace in enumerate(("1" * 32, "2" * 32, "3" * 32)):
        store.add([record(trace, "1", start_ns=1_000 * (3 - i), end_ns=1_000 * (3 - i) + 500)])
    listed = store.summaries(TraceQuery(limit=2))
    assert [s["trace_id"] for s in listed] == ["1" * 32, "2" * 32]


def test_a_trace_has_its_root_children_duration_services_and_error(store: TraceStore) -> None:
    # GIVEN a router span with a failing GPU child and a CPU child, the child first
    store.add(
        [
            record(
                TRACE_A,
                "2",
                "1",
                name="gpu infer",
                service="spillway-gpu",
                status="error",
                start_ns=2_000_000,
                end_ns=3_000_000,
            ),
            record(
                TRACE_A,
                "3",
                "1",
                name="cpu infer",
                service="spillway-cpu",
                start_ns=3_000_000,
                end_ns=9_000_000,
            ),
            record(TRACE_A, "1", name="POST /infer", start_ns=1_000_000, end_ns=10_000_000),
        ]
    )
    # WHEN it is read back
    trace = store.trace(TRACE_A.upper())
    # THEN the root is the span without a parent, its children name it, spans by start
    assert trace is not None
    assert trace["root"] == "POST /infer"
    assert [(s["name"], s["parent_span_id"]) for s in trace["spans"]] == [
        ("POST /infer", None),
        ("gpu infer", "1".rjust(16, "0")),
        ("cpu infer", "1".rjust(16, "0")),
    ]
    assert trace["services"] == ["spillway-cpu", "spillway-gpu", "spillway-router"]
    assert (trace["duration_ms"], trace["error"]) == (9.0, True)
    assert trace["spans"][2]["duration_ms"] == 6.0


def test_a_trace_whose_root_has_not_arrived_shows_its_earliest_orphan(store: TraceStore) -> None:
    store.add([record(TRACE_A, "3", "1", start_ns=30), record(TRACE_A, "2", "1", start_ns=20)])
    assert store.summaries()[0]["root"] == "op-2"


def test_filters_by_service_name_duration_and_tenant(store: TraceStore) -> None:
    # GIVEN two tenants' traces: acme's short on the GPU, globex's long on the CPU
    store.add(
        [
            record(
                TRACE_A,
                "1",
                name="infer digits",
                service="spillway-gpu",
                attributes={"spillway.tenant": "acme"},
                start_ns=0,
                end_ns=2_000_000,
            )
        ]
    )
    store.add(
        [
            record(
                TRACE_B,
                "1",
                name="infer minilm",
                service="spillway-cpu",
                attributes={"spillway.tenant": "globex"},
                start_ns=0,
                end_ns=50_000_000,
            )
        ]
    )

    def ids(query: TraceQuery) -> list[str]:
        return [s["trace_id"] for s in store.summaries(query)]

    # THEN each filter keeps only the trace it names
    assert ids(TraceQuery(tenant="acme")) == [TRACE_A]
    assert ids(TraceQuery(tenant="globex")) == [TRACE_B]
    assert ids(TraceQuery(service="spillway-cpu")) == [TRACE_B]
    assert ids(TraceQuery(name="DIGITS")) == [TRACE_A]
    assert ids(TraceQuery(min_ms=10)) == [TRACE_B]
    assert ids(TraceQuery(tenant="acme", service="spillway-cpu")) == []


def test_threads_adding_at_once_lose_no_span() -> None:
    # GIVEN 8 threads released together, each adding 200 spans of its own trace
    store = TraceStore(max_traces=100, max_spans=10_000, max_spans_per_trace=1000)
    start = threading.Barrier(8)

    def add(n: int) -> None:
        start.wait(timeout=10)
        for i in range(200):
            store.add([record(f"{n + 1:032x}", f"{i + 1:x}")])

    threads = [threading.Thread(target=add, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    # THEN every span is held, each in its trace
    assert store.counts() == (8, 1600)
    assert all(s["span_count"] == 200 for s in store.summaries(TraceQuery(limit=100)))


# --- OTLP in ----------------------------------------------------------------------------


def test_a_protobuf_export_is_kept_with_parent_links_events_and_status(
    client: Client, store: TraceStore
) -> None:
    # GIVEN an export of a server span and its client child, which links to another trace
    root = proto_span(TRACE_A, "00f067aa0ba902b7", kind=Span.SPAN_KIND_SERVER)
    root.name = "POST /v2/models/digits/infer"
    root.attributes.extend([attribute("spillway.tenant", "acme"), attribute("http.status", 200)])
    child = proto_span(
        TRACE_A, "b7ad6b7169203331", "00f067aa0ba902b7", start=1_200_000, end=1_800_000
    )
    child.name, child.kind = "gpu attempt", Span.SPAN_KIND_CLIENT
    child.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR, message="refused"))
    child.links.add(trace_id=bytes.fromhex(TRACE_B), span_id=bytes.fromhex("53995c3f42cd8ad8"))
    child.events.add(name="retry", time_unix_nano=1_500_000).attributes.append(attribute("n", 1))
    body = export("spillway-router", root, child).SerializeToString()
    # WHEN it is posted as Protobuf
    answer = client.post("/v1/traces", data=body, headers=PROTOBUF)
    # THEN it is a Protobuf ExportTraceServiceResponse without partial success
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/x-protobuf"
    assert not ExportTraceServiceResponse.FromString(answer.data).HasField("partial_success")
    # AND the API gives both spans as sent
    trace = json_of(client.get(f"/api/traces/{TRACE_A}"))
    first, second = trace["spans"]
    assert (first["name"], first["kind"], first["service"]) == (
        root.name,
        "server",
        "spillway-router",
    )
    assert first["attributes"] == {"spillway.tenant": "acme", "http.status": 200}
    assert second["parent_span_id"] == "00f067aa0ba902b7"
    assert second["status"] == {"code": "error", "message": "refused"}
    assert second["links"] == [
        {"trace_id": TRACE_B, "span_id": "53995c3f42cd8ad8", "attributes": {}}
    ]
    assert second["events"] == [{"name": "retry", "time_ns": 1_500_000, "attributes": {"n": 1}}]
    assert (second["start_ns"], second["end_ns"], second["duration_ms"]) == (
        1_200_000,
        1_800_000,
        0.6,
    )
    assert store.counts() == (1, 2)


def test_an_otlp_json_export_with_hex_ids_is_kept(client: Client) -> None:
    document = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [
                        {"key": "service.name", "value": {"stringValue": "spillway-cpu"}}
                    ]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "spillway"},
                        "spans": [
                            {
                                "traceId": TRACE_B.upper(),
                                "spanId": "53995c3f42cd8ad8",
                                "parentSpanId": "00f067aa0ba902b7",
                                "name": "cpu infer",
                                "kind": 2,
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000000005000000",
                                "attributes": [{"key": "batch", "value": {"intValue": "4"}}],
                                "links": [{"traceId": TRACE_A, "spanId": "b7ad6b7169203331"}],
                                "status": {"code": 1},
                                "someFutureField": True,
                            }
                        ],
                    }
                ],
            }
        ]
    }
    answer = client.post("/v1/traces", json=document)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json; charset=utf-8"
    assert json_of(answer) == {}
    (span,) = json_of(client.get(f"/api/traces/{TRACE_B}"))["spans"]
    assert (span["service"], span["kind"], span["status"]["code"]) == (
        "spillway-cpu",
        "server",
        "ok",
    )
    assert (span["parent_span_id"], span["duration_ms"]) == ("00f067aa0ba902b7", 5.0)
    assert span["attributes"] == {"batch": 4}
    assert span["links"][0]["trace_id"] == TRACE_A


def test_a_gzip_body_is_taken(client: Client) -> None:
    body = gzip.compress(export("spillway-gpu", proto_span(TRACE_A, "1" * 16)).SerializeToString())
    headers = {**PROTOBUF, "content-encoding": "gzip"}
    assert client.post("/v1/traces", data=body, headers=headers).status_code == 200
    assert json_of(client.get(f"/api/traces/{TRACE_A}"))["services"] == ["spillway-gpu"]


def test_spans_with_invalid_ids_are_refused_as_a_partial_success(client: Client) -> None:
    body = export(
        "s", proto_span(TRACE_A, "1" * 16), proto_span("0" * 32, "2" * 16)
    ).SerializeToString()
    answer = client.post("/v1/traces", data=body, headers=PROTOBUF)
    partial = ExportTraceServiceResponse.FromString(answer.data).partial_success
    assert (answer.status_code, partial.rejected_spans) == (200, 1)
    assert "trace or span id" in partial.error_message
    assert json_of(client.get(f"/api/traces/{TRACE_A}"))["span_count"] == 1


def _status(data: bytes) -> tuple[str, str]:
    """The stable code and message of a Protobuf ``google.rpc.Status``."""
    status = status_pb2.Status.FromString(data)
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info.reason, status.message


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"\xff\xff\xff", PROTOBUF, 400, "invalid_input"),
        (b"\x1f\x8b\x08garbage", {**PROTOBUF, "content-encoding": "gzip"}, 400, "invalid_input"),
        (b"x" * (64 * 1024 + 1), PROTOBUF, 413, "payload_too_large"),
        (
            gzip.compress(b"\0" * (1024 * 1024)),
            {**PROTOBUF, "content-encoding": "gzip"},
            413,
            "payload_too_large",
        ),
        (b"{}", {**PROTOBUF, "content-encoding": "br"}, 415, "unsupported_media_type"),
    ],
)
def test_bad_protobuf_bodies_get_a_status_with_a_stable_code(
    client: Client, body: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    answer = client.post("/v1/traces", data=body, headers=headers)
    assert (answer.status_code, answer.headers["content-type"]) == (
        status,
        "application/x-protobuf",
    )
    assert _status(answer.data)[0] == code


@pytest.mark.parametrize(
    ("body", "content_type", "status", "code"),
    [
        (b"{not json", "application/json", 400, "invalid_input"),
        (b"[1, 2]", "application/json", 400, "invalid_input"),
        (
            b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
            "application/json",
            400,
            "invalid_input",
        ),
        (b'{"resourceSpans": 7}', "application/json", 400, "invalid_input"),
        (b"hello", "text/plain", 415, "unsupported_media_type"),
        (b"{}", "", 415, "unsupported_media_type"),
    ],
)
def test_bad_json_bodies_and_other_types_get_a_json_status(
    client: Client, body: bytes, content_type: str, status: int, code: str
) -> None:
    answer = client.post("/v1/traces", data=body, headers={"content-type": content_type})
    assert answer.status_code == status
    assert answer.headers["content-type"] == "application/json; charset=utf-8"
    details = json_of(answer)["details"][0]
    assert (details["reason"], details["domain"]) == (code, "spillway")
    assert json_of(answer)["message"]


# --- the query API and the pages ----------------------------------------------------------


def test_the_list_api_filters_by_tenant_and_checks_its_parameters(
    client: Client, store: TraceStore
) -> None:
    store.add([record(TRACE_A, "1", attributes={"spillway.tenant": "acme"}, end_ns=5_000_000)])
    store.add([record(TRACE_B, "1", attributes={"spillway.tenant": "globex"}, end_ns=5_000_000)])
    listed = json_of(client.get("/api/traces?tenant=globex&min_ms=1&limit=5"))["traces"]
    assert [t["trace_id"] for t in listed] == [TRACE_B]
    assert listed[0]["span_count"] == 1
    for bad in ("limit=0", "limit=1001", "limit=x", "min_ms=-1", "min_ms=nan", "name=" + "n" * 201):
        answer = client.get(f"/api/traces?{bad}")
        assert (answer.status_code, json_of(answer)["code"]) == (400, "invalid_input"), bad


def test_one_trace_is_404_until_it_arrives_and_a_bad_id_is_400(client: Client) -> None:
    missing = client.get(f"/api/traces/{TRACE_A}")
    assert (missing.status_code, json_of(missing)["code"]) == (404, "not_found")
    bad = client.get("/api/traces/not-a-trace")
    assert (bad.status_code, json_of(bad)["code"]) == (400, "invalid_input")
    wrong = client.get("/v1/traces")
    assert wrong.status_code == 405
    assert json_of(client.post("/api/traces"))["code"] == "method_not_allowed"


def test_the_pages_and_their_files_are_served_from_here_only(client: Client) -> None:
    for path in ("/traces", f"/traces/{TRACE_A}"):
        page = client.get(path)
        assert page.status_code == 200
        assert b'<script src="/static/traces.js">' in page.data
        assert page.headers["content-security-policy"].startswith("default-src 'self'")
    script = client.get("/static/traces.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert b"/api/traces" in script.data
    assert client.get("/static/dashboard.js").status_code == 404
    assert client.get("/static/../server.py").status_code == 404
    assert json_of(client.get("/api/health")) == {"live": True, "traces": 0, "spans": 0}
