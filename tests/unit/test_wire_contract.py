"""What every transport reads off the wire (``spillway.protocol.wire``, ``framing``,
``replies`` and ``s3urls``), value by value.

Each server calls these helpers, so a value one of them accepts or refuses is accepted or
refused by all: here each rule is pinned at its edges (the last value taken, the first
refused) with literal figures, never the module's own constants."""

from __future__ import annotations

import json
from typing import Any

import pytest

from spillway.protocol.errors import (
    InvalidInputError,
    InvalidModelNameError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    RouteNotFoundError,
)
from spillway.protocol.framing import (
    NOT_UTF8,
    has_surrogate_escape,
    load_json_object,
    parse_header_length,
    read_json_header,
    split_body,
    utf8_text,
)
from spillway.protocol.replies import Reply, infer_reply, json_bytes, json_reply
from spillway.protocol.s3urls import S3Location, is_s3_url, parse_s3_url
from spillway.protocol.wire import (
    InferParameters,
    Target,
    allow,
    body_over_limit,
    int_parameter,
    latency_budget_ms,
    model_target,
    priority_hint,
    read_tenant_scope,
    require_model_target,
    routing_mode,
    strip_stage,
    tenant_hint,
)


def refused(call: Any, *args: Any) -> str:
    """The message of the ``InvalidInputError`` that ``call(*args)`` raises."""
    with pytest.raises(InvalidInputError) as caught:
        call(*args)
    return caught.value.message


# -- limits ---------------------------------------------------------------------------------


def test_the_synchronous_limits_are_lambdas() -> None:
    from spillway.protocol import wire

    assert wire.LAMBDA_PAYLOAD_BYTES == 6_291_456
    assert wire.EVENT_ENVELOPE_BYTES == 131_072
    assert wire.SYNC_BODY_BYTES == 4_620_288
    assert wire.MAX_TIMEOUT_US == 3_600_000_000
    assert wire.MAX_PRIORITY == 1_000_000


def test_a_body_over_the_limit_names_its_size_the_limit_and_the_way_out() -> None:
    error = body_over_limit(5000, 4000)
    assert isinstance(error, PayloadTooLargeError)
    assert error.status == 413
    assert error.message.startswith(
        "request body of 5000 bytes exceeds the synchronous limit of 4000 bytes; run larger"
    )
    assert "POST /v1/jobs" in error.message
    assert body_over_limit(7, 6, "answer").message.startswith("answer of 7 bytes exceeds")


# -- header length and body split -----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "length"), [(None, None), ("0", 0), (" 368 ", 368), ("9" * 12, 999_999_999_999)]
)
def test_header_lengths_taken(value: str | None, length: int | None) -> None:
    assert parse_header_length(value) == length


@pytest.mark.parametrize("value", ["+368", "1_0", "\u0663", "-1", "", "1" * 13, "1.0"])
def test_header_lengths_refused(value: str) -> None:
    assert "Inference-Header-Content-Length" in refused(parse_header_length, value)


def test_a_body_splits_at_its_header_length() -> None:
    header, rest = split_body(b"abcdef", 3)
    assert (header, bytes(rest)) == (b"abc", b"def")
    header, rest = split_body(b"abcdef", 0)
    assert (header, bytes(rest)) == (b"", b"abcdef")
    header, rest = split_body(b"abcdef", 6)
    assert (header, bytes(rest)) == (b"abcdef", b"")
    header, rest = split_body(b"{}", None)
    assert (header, bytes(rest)) == (b"{}", b"")


@pytest.mark.parametrize("length", [7, -1])
def test_a_header_length_outside_the_body_is_refused(length: int) -> None:
    message = refused(split_body, b"abcdef", length)
    assert message == (f"Inference-Header-Content-Length {length} is outside the body of 6 bytes")


# -- JSON text ------------------------------------------------------------------------------


def test_utf8_text_is_strict() -> None:
    assert utf8_text(b"plain") == "plain"
    assert utf8_text("caf\u00e9".encode()) == "caf\u00e9"
    for raw in (b"\xff", b"\xed\xa0\x80", b"\xc0\xaf", b"caf\xe9"):
        assert refused(utf8_text, raw) == NOT_UTF8


@pytest.mark.parametrize(
    ("raw", "has"),
    [
        (b'"\\ud83d"', True),
        (b'"\\uD800"', True),
        (b'"\\udbff"', True),
        (b'"\\udfff"', True),
        (b'"\\ud7ff"', False),
        (b'"\\ue000"', False),
        (b'"\\u00e9"', False),
        (b'"no escape at all"', False),
        (b'"\\\\"', False),
    ],
)
def test_surrogate_escapes_are_found(raw: bytes, has: bool) -> None:
    assert has_surrogate_escape(raw) is has


def test_json_objects_are_read_tolerantly() -> None:
    assert load_json_object(b'{"a": [1, 2]}') == {"a": [1, 2]}
    assert load_json_object('{"t": "caf\u00e9"}') == {"t": "caf\u00e9"}
    assert load_json_object(b'{"s": "\\ud83d\\ude00"}') == {"s": "\U0001f600"}
    value = load_json_object(b'{"n": NaN, "i": -Infinity}')
    assert value["n"] != value["n"]
    assert value["i"] == float("-inf")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"s": "\\ud800"}', NOT_UTF8),
        (b'{"s": "\\udc00x"}', NOT_UTF8),
        ('{"s": "\ud800"}', NOT_UTF8),
        (b"\xff{}", NOT_UTF8),
        (b"", "invalid JSON: Expecting value at position 0"),
        (
            b"{'a': 1}",
            "invalid JSON: Expecting property name enclosed in double quotes at position 1",
        ),
        (b"[1]", "the JSON header must be an object"),
        (b'"text"', "the JSON header must be an object"),
        (b"[" * 100_000, "invalid JSON: nested too deeply"),
        (b'{"n": ' + b"1" * 5000 + b"}", "invalid JSON: a number is too long"),
    ],
)
def test_json_objects_refused(raw: bytes | str, message: str) -> None:
    assert refused(load_json_object, raw) == message


def test_an_infer_header_is_read_off_the_body_and_its_parameters_are_an_object() -> None:
    body = b'{"parameters": {"timeout": 5}}' + b"\x00\x01"
    assert read_json_header(body, 30) == {"parameters": {"timeout": 5}}
    assert read_json_header(b'{"inputs": []}', None) == {"inputs": []}
    assert refused(read_json_header, b'{"parameters": [1]}', None) == (
        "parameters must be an object"
    )


# -- tenant scope ---------------------------------------------------------------------------


def test_tenant_scopes() -> None:
    scope = "0123456789abcdef" * 2
    assert read_tenant_scope(None) == "-"
    assert read_tenant_scope("-") == "-"
    assert read_tenant_scope(scope) == scope
    for bad in (scope.upper(), scope[:-1], scope + "0", scope + "\n", "", "--", "anonymous"):
        assert "x-spillway-tenant-scope" in refused(read_tenant_scope, bad)


# -- request parameters ---------------------------------------------------------------------


def test_integer_parameters() -> None:
    assert int_parameter(None, "timeout") is None
    assert int_parameter({}, "timeout") is None
    assert int_parameter({"timeout": None}, "timeout") is None
    assert int_parameter({"timeout": 0}, "timeout") == 0
    assert int_parameter({"timeout": 4}, "timeout", 4) == 4
    for bad in (True, 1.0, "1", -1):
        assert refused(int_parameter, {"timeout": bad}, "timeout") == (
            "parameter 'timeout' must be a non-negative integer"
        )
    assert refused(int_parameter, {"timeout": 5}, "timeout", 4) == (
        "parameter 'timeout' must be at most 4"
    )


def test_routing_modes() -> None:
    assert routing_mode(None) is None
    for mode in ("auto", "realtime", "serverless", "batch", "async"):
        assert routing_mode(mode) == mode
    assert refused(routing_mode, "fast") == (
        "mode must be one of auto, realtime, serverless, batch, async"
    )


@pytest.mark.parametrize(
    ("value", "budget"),
    [(None, None), (100, 100.0), ("150", 150.0), (3_600_000, 3_600_000.0), ("2.5e3", 2500.0)],
)
def test_latency_budgets_taken(value: Any, budget: float | None) -> None:
    assert latency_budget_ms(value) == budget


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (99, "latency_budget_ms must be between 100 and 3600000"),
        (99.999, "latency_budget_ms must be between 100 and 3600000"),
        (3_600_001, "latency_budget_ms must be between 100 and 3600000"),
        ("soon", "latency_budget_ms must be a number"),
        (True, "latency_budget_ms must be a finite number"),
        ([150], "latency_budget_ms must be a finite number"),
        (float("nan"), "latency_budget_ms must be a finite number"),
        ("inf", "latency_budget_ms must be a finite number"),
        (10**400, "latency_budget_ms is out of range"),
    ],
)
def test_latency_budgets_refused(value: Any, message: str) -> None:
    assert refused(latency_budget_ms, value) == message


def test_priority_hints() -> None:
    assert priority_hint(None) is None
    assert priority_hint("3") == 3
    assert priority_hint("2.0") == 2
    assert priority_hint(0) == 0
    assert priority_hint(1_000_000) == 1_000_000
    for bad in ("3.5", "-1", 1_000_001):
        assert refused(priority_hint, bad) == "priority must be a non-negative integer"


def test_tenant_hints() -> None:
    assert tenant_hint(None) is None
    for good in ("acme", "a", "A" * 128, "team.a:b@c-d_e", "0tenant"):
        assert tenant_hint(good) == good
    for bad in ("", "A" * 129, "-acme", ".acme", "a b", "acme\n", 5):
        assert refused(tenant_hint, bad) == "tenant must be 1-128 letters, digits or ._:@-"


def test_infer_parameters() -> None:
    assert InferParameters.of(None) == InferParameters(None, None)
    assert InferParameters.of({}) == InferParameters(None, None)
    assert InferParameters.of({"timeout": 0}).timeout_us is None  # 0: none, as in Triton
    given = InferParameters.of({"timeout": 1500, "priority": 2})
    assert (given.timeout_us, given.priority, given.timeout_s) == (1500, 2, 0.0015)
    assert InferParameters().timeout_s is None
    assert InferParameters.of({"timeout": 3_600_000_000}).timeout_s == 3600.0
    assert "at most 3600000000" in refused(InferParameters.of, {"timeout": 3_600_000_001})
    assert "at most 1000000" in refused(InferParameters.of, {"priority": 1_000_001})
    assert "mode" in refused(InferParameters.of, {"mode": "fast"})
    assert "latency_budget_ms" in refused(InferParameters.of, {"latency_budget_ms": 1})
    assert "tenant" in refused(InferParameters.of, {"tenant": "a b"})
    ok = {"mode": "auto", "latency_budget_ms": 200, "tenant": "acme", "priority": 0}
    assert InferParameters.of(ok) == InferParameters(None, 0)


# -- paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "target"),
    [
        ("/v2/models/m", Target("metadata", "m")),
        ("/v2/models/m/ready", Target("ready", "m")),
        ("/v2/models/m/config", Target("config", "m")),
        ("/v2/models/m/stats", Target("stats", "m")),
        ("/v2/models/m/versions/2", Target("metadata", "m", "2")),
        ("/v2/models/m/versions/2/infer", Target("infer", "m", "2")),
        ("/v2/models/stats", Target("stats")),
        ("/v2/models/stats/ready", Target("ready", "stats")),
        ("/v2/models/stats/versions/1", Target("metadata", "stats", "1")),
        ("/v2/models", None),
        ("/v2/models/m/explain", None),
        ("/v2/models/m/versions/2/infer/", None),
        ("/v2/health/ready", None),
        ("/x/v2/models/m", None),
    ],
)
def test_model_paths(path: str, target: Target | None) -> None:
    assert model_target(path) == target


@pytest.mark.parametrize("path", ["/v2/models/m/versions/0", "/v2/models/m/versions/v1"])
def test_a_bad_version_in_a_path_is_refused(path: str) -> None:
    with pytest.raises(InvalidModelNameError):
        model_target(path)


@pytest.mark.parametrize(
    ("target", "path", "method"),
    [
        (Target("server"), "/v2", "GET"),
        (Target("stats"), "/v2/models/stats", "GET"),
        (Target("metadata", "m"), "/v2/models/m", "GET"),
        (Target("metadata", "m", "3"), "/v2/models/m/versions/3", "GET"),
        (Target("ready", "m"), "/v2/models/m/ready", "GET"),
        (Target("infer", "m", "3"), "/v2/models/m/versions/3/infer", "POST"),
    ],
)
def test_canonical_paths_and_methods(target: Target, path: str, method: str) -> None:
    assert (target.path, target.method) == (path, method)
    assert model_target(path) in (target, None)


def test_a_path_that_names_no_model_is_404() -> None:
    assert require_model_target("/v2/models/m/ready") == Target("ready", "m")
    with pytest.raises(RouteNotFoundError) as caught:
        require_model_target("/nowhere/" + "x" * 300)
    assert caught.value.message == "no route for /nowhere/" + "x" * 191


def test_only_the_allowed_method_passes() -> None:
    allow("POST", "/p", "POST")
    with pytest.raises(MethodNotAllowedError) as caught:
        allow("DELETE" * 4, "/p" * 150, "GET")
    assert caught.value.allow == "GET"
    assert caught.value.message == f"{('DELETE' * 4)[:16]} is not allowed on {('/p' * 150)[:200]}"


@pytest.mark.parametrize(
    ("path", "event", "stripped"),
    [
        ("/prod/v2/x", {"version": "2.0", "requestContext": {"stage": "prod"}}, "/v2/x"),
        ("/v2/x", {"version": "2.0", "requestContext": {"stage": "$default"}}, "/v2/x"),
        ("/prod/v2/x", {"version": "2.0", "requestContext": {"stage": "$default"}}, "/prod/v2/x"),
        ("/prod", {"version": "2.0", "requestContext": {"stage": "prod"}}, "/prod"),
        ("/production/x", {"version": "2.0", "requestContext": {"stage": "prod"}}, "/production/x"),
        ("/prod/v2/x", {"version": "1.0", "requestContext": {"stage": "prod"}}, "/prod/v2/x"),
        ("/prod/v2/x", {"requestContext": {"stage": "prod"}}, "/prod/v2/x"),
        ("/prod/v2/x", {"version": "2.0"}, "/prod/v2/x"),
        ("/prod/v2/x", {"version": "2.0", "requestContext": None}, "/prod/v2/x"),
        ("/prod/v2/x", None, "/prod/v2/x"),
    ],
)
def test_an_http_api_stage_is_stripped(path: str, event: Any, stripped: str) -> None:
    assert strip_stage(path, event) == stripped


# -- s3:// ------------------------------------------------------------------------------------


def test_s3_locations() -> None:
    assert is_s3_url("s3://b")
    assert not is_s3_url("S3://bucket/x")
    assert parse_s3_url("s3://my-bucket/in/put/") == S3Location("my-bucket", "in/put/")
    assert parse_s3_url("s3://my-bucket") == S3Location("my-bucket", "")
    assert parse_s3_url("s3://my-bucket//x") == S3Location("my-bucket", "x")
    assert parse_s3_url("s3://abc/") == S3Location("abc", "")
    assert parse_s3_url("s3://" + "b" * 63 + "/k") == S3Location("b" * 63, "k")
    assert parse_s3_url("s3://bkt/" + "k" * 1015).prefix == "k" * 1015  # 1024 characters
    location = S3Location("bkt", "out/")
    assert location.url == "s3://bkt/out/"
    assert location.key("a", "/b/") == "out/a/b"
    assert S3Location("bkt", "").key("", "x") == "x"


@pytest.mark.parametrize(
    ("value", "what"),
    [
        ("https://bkt/k", "is not an s3://bucket/prefix location"),
        ("s3://bkt\\k", "is not an s3://bucket/prefix location"),
        ("s3://bkt/" + "k" * 1016, "is not an s3://bucket/prefix location"),
        ("s3://ab/k", "does not name a valid bucket"),
        ("s3://" + "b" * 64 + "/k", "does not name a valid bucket"),
        ("s3://Bucket/k", "does not name a valid bucket"),
        ("s3://my..bucket/k", "does not name a valid bucket"),
        ("s3://-bucket/k", "does not name a valid bucket"),
        ("s3:///k", "does not name a valid bucket"),
    ],
)
def test_s3_locations_refused(value: str, what: str) -> None:
    assert refused(parse_s3_url, value) == f"{value[:200]!r} {what}"


# -- replies ----------------------------------------------------------------------------------


def test_replies_are_exact() -> None:
    assert json_bytes({"a": [1, 2], "b": "c"}) == b'{"a":[1,2],"b":"c"}'
    reply = json_reply(201, {"ok": True}, [("x-a", "1")])
    assert reply == Reply(201, [("content-type", "application/json"), ("x-a", "1")], b'{"ok":true}')
    assert json_reply(200, []).headers == [("content-type", "application/json")]
    assert reply.header("x-a") == "1"
    assert reply.header("x-b") is None
    assert Reply(200, [("a", "1"), ("a", "2")], b"").header("a") == "1"


def test_infer_replies_are_exact() -> None:
    as_json = infer_reply(b"{}", None, 3)
    assert as_json == Reply(
        200, [("x-spillway-model-version", "3"), ("content-type", "application/json")], b"{}"
    )
    binary = infer_reply(b"{}\x00\x00", 2, 7, [("x-spillway-busy", "0.5")])
    assert binary.headers == [
        ("x-spillway-model-version", "7"),
        ("x-spillway-busy", "0.5"),
        ("content-type", "application/octet-stream"),
        ("inference-header-content-length", "2"),
    ]
    assert json.loads(binary.body[:2]) == {}


# -- what the survivors of a mutation run showed unpinned -------------------------------------


class CountingStream:
    """A body stream that records how much each read asks for."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.asked: list[int | None] = []

    def read(self, size: int | None = None) -> bytes:
        self.asked.append(size)
        chunk = self.data if size is None or size < 0 else self.data[:size]
        self.data = self.data[len(chunk) :]
        return chunk


def test_a_wsgi_body_is_never_read_past_its_declared_length_or_the_limit() -> None:
    from spillway.protocol.wire import read_wsgi_body

    declared = CountingStream(b"abcdef")
    assert read_wsgi_body({"CONTENT_LENGTH": "3", "wsgi.input": declared}, 1000) == b"abc"
    assert declared.asked == [3]
    chunked = CountingStream(b"z" * 5000)
    with pytest.raises(PayloadTooLargeError) as caught:
        read_wsgi_body({"wsgi.input": chunked, "wsgi.input_terminated": True}, 1000)
    assert chunked.asked == [1001]
    assert caught.value.message.startswith(
        "chunked request body (at least) of 1001 bytes exceeds the synchronous limit of 1000"
    )
    with pytest.raises(PayloadTooLargeError) as caught:
        read_wsgi_body({"CONTENT_LENGTH": "1001", "wsgi.input": CountingStream(b"")}, 1000)
    assert caught.value.message.startswith(
        "request body of 1001 bytes exceeds the synchronous limit of 1000 bytes"
    )


def test_refusal_messages_name_what_was_refused() -> None:
    assert refused(parse_header_length, "x") == (
        "Inference-Header-Content-Length must be a non-negative integer"
    )
    assert refused(priority_hint, "soon") == "priority must be a number"
    assert refused(priority_hint, float("inf")) == "priority must be a finite number"
    long = "s3://Bucket/" + "k" * 300
    assert refused(parse_s3_url, long) == f"{long[:200]!r} does not name a valid bucket"


def test_a_stage_named_like_default_is_only_stripped_when_it_is_not_default() -> None:
    event = {"version": "2.0", "requestContext": {"stage": "$default"}}
    assert strip_stage("/$default/v2/x", event) == "/$default/v2/x"


def test_s3_keys_and_prefixes_strip_slashes_only() -> None:
    location = S3Location("bkt", "XX/")
    assert location.key("Xa", "XX", "b/") == "XX/Xa/XX/b"
    assert S3Location("bkt", "").key(" ", "/") == " "
    assert parse_s3_url("s3://bkt//Xkey") == S3Location("bkt", "Xkey")
