"""Data capture's configuration, sampling and record: the policy's ``capture`` section
validated strictly, seeded sampling, and one record per request with every field."""

from __future__ import annotations

import base64
import json
import random
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spillway.capture.buffer import CaptureBuffer
from spillway.capture.records import RECORD_OVERHEAD_BYTES, captured, parse_record, record_of
from spillway.capture.watcher import Capture
from spillway.capture.writer import CaptureWriter
from spillway.policy.accounting import EmfSink
from spillway.policy.rules import CaptureRule, Policy, PolicyError, parse_policy
from spillway.protocol.replies import Reply
from spillway_cli.main import app as cli
from tests.unit.capture_support import BODY, RESULT, Clock, metadata_routed, routed

ROOT = Path(__file__).resolve().parents[2]
WHEN = datetime(2026, 1, 15, 12, 30, 5, tzinfo=UTC)
RULES = "rules:\n  - name: default\n    route: gpu\n"


def _policy(capture: str) -> Policy:
    return parse_policy(RULES + capture, "test.yaml")


# --- configuration ------------------------------------------------------------------


def test_no_capture_section_captures_nothing() -> None:
    policy = _policy("")
    assert policy.capture == []
    assert policy.capture_rule("digits", "acme") is None


def test_an_entry_has_defaults_for_all_but_its_rate() -> None:
    policy = _policy("capture:\n  - {sample: 0.5}\n")
    assert policy.capture == [
        CaptureRule(model="*", tenant=None, sample=0.5, keep="both", errors=True)
    ]


def test_the_first_entry_that_applies_decides() -> None:
    policy = _policy(
        "capture:\n"
        "  - {model: 'digits', tenant: 'acme', sample: 0, keep: inputs}\n"
        "  - {model: 'dig*', sample: 0.1, keep: outputs, errors: false}\n"
        "  - {model: '*', tenant: 'globex', sample: 1}\n"
    )
    acme = policy.capture_rule("digits", "acme")
    assert acme is not None
    assert acme.sample == 0
    assert acme.keep == "inputs"
    other = policy.capture_rule("digits", "initech")
    assert other is not None
    assert other.sample == 0.1
    assert not other.errors
    assert policy.capture_rule("minilm", "globex") == CaptureRule(
        model="*", tenant="globex", sample=1
    )
    # an entry naming a tenant never applies to the anonymous tenant
    assert policy.capture_rule("minilm", None) is None
    assert policy.capture_rule("minilm", "initech") is None


@pytest.mark.parametrize(
    ("capture", "said"),
    [
        ("capture:\n  - {sample: 1.5}\n", "capture.0.sample"),
        ("capture:\n  - {sample: -0.1}\n", "capture.0.sample"),
        ("capture:\n  - {model: digits}\n", "capture.0.sample: Field required"),
        ("capture:\n  - {sample: 1, keep: everything}\n", "capture.0.keep"),
        ("capture:\n  - {sample: 1, rate: 2}\n", "capture.0.rate"),
        ("capture:\n  - {sample: 1, model: ''}\n", "capture.0.model"),
        ("capture:\n  - {sample: 1, errors: maybe}\n", "capture.0.errors"),
        ("capture: {sample: 1}\n", "capture: Input should be a valid list"),
        (
            "capture:\n  - {sample: 1}\n  - {model: digits, sample: 0}\n",
            "capture[0] matches every model and tenant",
        ),
    ],
)
def test_a_bad_capture_section_is_refused_with_where_and_why(capture: str, said: str) -> None:
    with pytest.raises(PolicyError) as refused:
        _policy(capture)
    assert said in str(refused.value)


def test_policy_check_reports_a_bad_capture_section(tmp_path: Path) -> None:
    # GIVEN a policy file whose capture section samples at 2
    path = tmp_path / "policy.yaml"
    path.write_text(RULES + "capture:\n  - {model: digits, sample: 2}\n")
    # WHEN `spillway policy check` reads it
    result = CliRunner().invoke(cli, ["policy", "check", str(path)])
    # THEN it fails, naming the entry and the field
    assert result.exit_code == 1
    assert "capture.0.sample" in result.output


def test_the_example_policy_shows_a_capture_section() -> None:
    policy = parse_policy((ROOT / "policies" / "example.yaml").read_text(), "example.yaml")
    assert policy.capture, "policies/example.yaml shows how capture is configured"


# --- sampling -----------------------------------------------------------------------


def _capture(seed: int | None = 3, **policy: str) -> tuple[Capture, CaptureBuffer]:
    clock = Clock()
    buffer = CaptureBuffer(max_bytes=10**8, flush_bytes=10**8, flush_s=60, clock=clock)
    writer = CaptureWriter(buffer, "s3://bucket/capture", lambda *_: None, EmfSink())
    chosen = _policy(policy.get("capture", "capture:\n  - {sample: 1}\n"))
    rng = random.Random(seed) if seed is not None else None
    capture = Capture(
        writer,
        lambda: chosen,
        max_record_bytes=1024 * 1024,
        rng=rng,
        clock=clock,
        wall=lambda: WHEN,
    )
    return capture, buffer


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5, 1.0])
def test_sampling_keeps_the_rate_and_repeats_with_its_seed(rate: float) -> None:
    rule = CaptureRule(sample=rate)
    first, _ = _capture(seed=11)
    second, _ = _capture(seed=11)
    draws = [first.sampled(rule) for _ in range(4000)]
    # THEN the same seed draws the same requests, at about the rate
    assert draws == [second.sampled(rule) for _ in range(4000)]
    assert abs(sum(draws) / 4000 - rate) < 0.03
    if rate in (0.0, 1.0):
        assert all(d == bool(rate) for d in draws)


def test_only_sampled_inference_requests_are_kept() -> None:
    capture, buffer = _capture(capture="capture:\n  - {model: digits, sample: 1}\n")
    capture(routed())
    capture(routed(path="/v2/models/minilm/infer"))  # no entry applies
    capture(metadata_routed())  # not inference
    assert buffer.accepted == 1


def test_errors_false_leaves_failed_requests_out() -> None:
    capture, buffer = _capture(capture="capture:\n  - {sample: 1, errors: false}\n")
    failed = Reply(400, [("content-type", "application/json")], b'{"error":"x","code":"y"}')
    capture(routed(reply=failed))
    assert buffer.accepted == 0
    capture(routed())
    assert buffer.accepted == 1


# --- the record ---------------------------------------------------------------------


def test_a_json_request_and_its_answer_make_one_record_with_every_field() -> None:
    item = captured(
        routed(), CaptureRule(sample=0.5), at=WHEN, record_id="r1", max_body_bytes=10**6
    )
    record = record_of(item)
    document = json.loads(record.line())
    assert document == {
        "schema": 1,
        "id": "r1",
        "time": "2026-01-15T12:30:05Z",
        "request_id": "req-1",
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "tenant": "acme",
        "model": "digits",
        "requested_version": None,
        "version": "1",
        "backend": "gpu",
        "rule": "default",
        "fallback": None,
        "spilled": False,
        "status": 200,
        "latency_ms": 12.3,
        "error": None,
        "sample": 0.5,
        "keep": "both",
        "request": {
            "content_type": "application/json",
            "header_length": None,
            "size": len(BODY),
            "encoding": "json",
            "data": json.loads(BODY),
            "omitted": False,
        },
        "response": {
            "content_type": "application/json",
            "header_length": None,
            "size": len(RESULT),
            "encoding": "json",
            "data": json.loads(RESULT),
            "omitted": False,
        },
        "truncated": False,
        "replayable": True,
    }
    # AND the line reads back as the same record, its bodies as they were sent
    again = parse_record(record.line())
    assert again == record
    assert again.request is not None
    assert json.loads(again.request.raw() or b"") == json.loads(BODY)


def test_a_binary_body_is_kept_byte_for_byte_with_its_header_length() -> None:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [1, 8, 8],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 256},
                }
            ]
        }
    ).encode()
    body = header + bytes(range(256))
    headers = {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }
    record = record_of(
        captured(
            routed(body=body, headers=headers),
            CaptureRule(sample=1),
            at=WHEN,
            record_id="r2",
            max_body_bytes=10**6,
        )
    )
    assert record.request is not None
    assert record.request.encoding == "base64"
    assert record.request.header_length == len(header)
    assert base64.b64decode(record.request.data) == body
    assert record.request.raw() == body
    assert record.replayable


def test_bodies_past_the_cap_are_left_out_and_the_record_is_truncated() -> None:
    big = Reply(200, [("content-type", "application/json")], b'{"outputs":[' + b" " * 5000 + b"]}")
    item = captured(
        routed(reply=big), CaptureRule(sample=1), at=WHEN, record_id="r3", max_body_bytes=4096
    )
    # THEN the request (first) is kept, the answer left out, and only the request is held
    assert item.size == RECORD_OVERHEAD_BYTES + len(BODY)
    record = record_of(item)
    assert record.truncated
    assert not record.replayable
    assert record.response is not None
    assert record.response.omitted
    assert record.response.data is None
    assert record.response.size == len(big.body)
    assert record.request is not None
    assert not record.request.omitted


@pytest.mark.parametrize(
    ("keep", "inputs", "outputs"), [("inputs", True, False), ("outputs", False, True)]
)
def test_keep_names_the_bodies_a_record_holds(keep: str, inputs: bool, outputs: bool) -> None:
    record = record_of(
        captured(
            routed(),
            CaptureRule(sample=1, keep=keep),
            at=WHEN,
            record_id="r4",
            max_body_bytes=10**6,
        )
    )
    assert (record.request is not None, record.response is not None) == (inputs, outputs)
    assert record.replayable == inputs
    assert record.keep == keep


def test_a_failed_request_keeps_its_error_code_and_message() -> None:
    failed = Reply(
        503,
        [("content-type", "application/json"), ("x-spillway-rule", "serverless-requested")],
        b'{"error":"no backend could serve the request (none)","code":"unavailable"}',
    )
    record = record_of(
        captured(
            routed(reply=failed, backend=None),
            CaptureRule(sample=1, keep="inputs"),
            at=WHEN,
            record_id="r5",
            max_body_bytes=10**6,
        )
    )
    assert record.status == 503
    assert record.backend is None
    assert record.error is not None
    assert record.error.code == "unavailable"
    assert "no backend" in record.error.message
    assert record.rule == "serverless-requested"


def test_a_body_that_is_not_json_is_kept_as_text_or_base64() -> None:
    text = record_of(
        captured(
            routed(body=b"not json {"), CaptureRule(sample=1), at=WHEN, record_id="t",
            max_body_bytes=10**6,
        )
    )  # fmt: skip
    assert text.request is not None
    assert text.request.encoding == "text"
    assert text.request.raw() == b"not json {"
    raw = b"\xff\xfe\x00"
    binary = record_of(
        captured(
            routed(body=raw), CaptureRule(sample=1), at=WHEN, record_id="b", max_body_bytes=10**6
        )
    )
    assert binary.request is not None
    assert binary.request.encoding == "base64"
    assert binary.request.raw() == raw
    nan = record_of(
        captured(
            routed(body=b'{"x": NaN}'), CaptureRule(sample=1), at=WHEN, record_id="n",
            max_body_bytes=10**6,
        )
    )  # fmt: skip
    # NaN is not JSON: the record stays valid JSON, the body kept as the text it was
    assert nan.request is not None
    assert nan.request.encoding == "text"
    json.loads(nan.line())
