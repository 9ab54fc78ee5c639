"""Replaying captured records: what is sent (the very bytes, to the version asked for),
and how answers are judged (numeric tolerance for float tensors, exact otherwise; a 4xx
by its status and code); what cannot be replayed is counted, never sent. And the
reader's filters (times, statuses) and the key layout listing relies on."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

from spillway.capture.layout import Area
from spillway.capture.reader import StatusFilter, parse_when
from spillway.capture.records import CaptureRecord, captured, record_of
from spillway.capture.replay import Answer, SendFailed, Tolerance, infer_path, replay
from spillway.policy.rules import CaptureRule, Keep
from spillway.protocol.codec import encode_response
from spillway.protocol.errors import SpillwayError
from spillway.protocol.replies import Reply
from tests.unit.capture_support import BODY, RESULT, routed

WHEN = datetime(2026, 1, 15, 12, 30, 5, tzinfo=UTC)
JSON = {"content-type": "application/json"}


def _record(reply: Reply | None = None, keep: Keep = "both", **kw: object) -> CaptureRecord:
    made = routed(reply=reply, **kw)  # type: ignore[arg-type]
    rule = CaptureRule(sample=1, keep=keep)
    return record_of(captured(made, rule, at=WHEN, record_id="r", max_body_bytes=10**6))


def _result(label: int = 3, probabilities: tuple[float, ...] = (0.25, 0.75)) -> bytes:
    document = json.loads(RESULT)
    document["outputs"][0]["data"] = [label]
    document["outputs"][1]["data"] = list(probabilities)
    return json.dumps(document).encode()


class Server:
    """Answers every request with one answer, and records what it was sent."""

    def __init__(self, answer: Answer | None) -> None:
        self.answer = answer
        self.sent: list[tuple[str, dict[str, str], bytes]] = []

    def __call__(self, path: str, headers: Mapping[str, str], body: bytes) -> Answer:
        self.sent.append((path, dict(headers), body))
        if self.answer is None:
            raise SendFailed("connection refused")
        return self.answer


def test_the_same_answer_matches_and_the_request_is_sent_as_it_came() -> None:
    server = Server(Answer(200, JSON, RESULT))
    report = replay([_record()], server)
    assert report.counts == {"matched": 1, "differed": 0, "not_replayable": 0, "failed": 0}
    [(path, headers, body)] = server.sent
    assert path == "/v2/models/digits/infer"
    assert json.loads(body) == json.loads(BODY)
    assert headers == {"content-type": "application/json"}


def test_a_version_given_is_where_each_request_goes() -> None:
    server = Server(Answer(200, JSON, RESULT))
    replay([_record()], server, version="2")
    assert server.sent[0][0] == "/v2/models/digits/versions/2/infer"
    assert infer_path("digits", None) == "/v2/models/digits/infer"


@pytest.mark.parametrize(
    ("answer", "verdict", "said"),
    [
        (_result(probabilities=(0.25 + 1e-7, 0.75)), "matched", ""),
        (_result(probabilities=(0.3, 0.7)), "differed", "'probabilities': 2 of 2 values beyond"),
        (_result(label=4), "differed", "'label': 1 of 1 values differ"),
        (_result(probabilities=(0.25, 0.75, 0.0)), "differed", "'probabilities': shape [1, 3]"),
        (
            json.dumps(
                {"model_name": "digits", "outputs": [json.loads(RESULT)["outputs"][0]]}
            ).encode(),
            "differed",
            "outputs ['label'], captured ['label', 'probabilities']",
        ),
        (b"not json", "differed", "the answer is not an inference response"),
    ],
)
def test_outputs_are_compared_within_the_tolerance(answer: bytes, verdict: str, said: str) -> None:
    # fix the shape of the longer answer, so the shape (not a parse error) is compared
    if b"0.0]" in answer:
        document = json.loads(answer)
        document["outputs"][1]["shape"] = [1, 3]
        answer = json.dumps(document).encode()
    report = replay([_record()], Server(Answer(200, JSON, answer)), tolerance=Tolerance(1e-5, 1e-6))
    [result] = report.results
    assert result.verdict == verdict
    assert said in result.reason


def test_a_binary_answer_compares_with_a_json_capture() -> None:
    arrays: dict[str, Any] = {
        "label": np.array([[3]], dtype=np.int64),
        "probabilities": np.array([[0.25, 0.75]], dtype=np.float32),
    }
    body, length = encode_response("digits", "1", None, arrays, binary={"label", "probabilities"})
    assert length is not None
    headers = {"content-type": "application/octet-stream",
               "inference-header-content-length": str(length)}  # fmt: skip
    report = replay([_record()], Server(Answer(200, headers, body)))
    assert report.counts["matched"] == 1


def test_a_status_that_changed_differs() -> None:
    report = replay([_record()], Server(Answer(503, JSON, b'{"error":"x","code":"unavailable"}')))
    assert report.results[0].verdict == "differed"
    assert report.results[0].reason == "status 503, captured 200"


def test_a_captured_refusal_matches_the_same_refusal() -> None:
    refused = Reply(400, [("content-type", "application/json")],
                    b'{"error":"bad shape","code":"invalid_input"}')  # fmt: skip
    record = _record(refused)
    same = Answer(400, JSON, b'{"error":"bad shape again","code":"invalid_input"}')
    other = Answer(400, JSON, b'{"error":"x","code":"invalid_datatype"}')
    assert replay([record], Server(same)).counts["matched"] == 1
    result = replay([record], Server(other)).results[0]
    assert result.verdict == "differed"
    assert result.reason == "error code invalid_datatype, captured invalid_input"


@pytest.mark.parametrize(
    ("reply", "keep", "said"),
    [
        (Reply(503, [], b'{"error":"x","code":"unavailable"}'), "both", "server failure (503)"),
        (Reply(202, [], b'{"id":"job"}'), "both", "the capture holds a 202"),
        (None, "inputs", "no captured answer"),
        (None, "outputs", "the request was not kept"),
    ],
)
def test_what_cannot_be_compared_is_counted_and_never_sent(
    reply: Reply | None, keep: Keep, said: str
) -> None:
    server = Server(Answer(200, JSON, RESULT))
    report = replay([_record(reply, keep)], server)
    assert report.counts["not_replayable"] == 1
    assert said in report.results[0].reason
    assert server.sent == []


def test_a_truncated_record_is_not_replayable() -> None:
    made = routed()
    item = captured(made, CaptureRule(sample=1), at=WHEN, record_id="r", max_body_bytes=100)
    report = replay([record_of(item)], Server(Answer(200, JSON, RESULT)))
    assert report.results[0].verdict == "not_replayable"
    assert "truncated" in report.results[0].reason


def test_no_answer_is_a_failure() -> None:
    report = replay([_record()], Server(None))
    assert report.counts["failed"] == 1
    assert "connection refused" in report.results[0].reason
    assert report.summary() == (
        "replayed 1 records: 0 matched, 0 differed, 0 not replayable, 1 failed"
    )


# --- reading back: the filters and the layout -------------------------------------------


def test_times_are_iso_8601_or_an_age() -> None:
    now = datetime(2026, 1, 15, 12, tzinfo=UTC)
    assert parse_when("90m", now) == datetime(2026, 1, 15, 10, 30, tzinfo=UTC)
    assert parse_when("7d", now) == datetime(2026, 1, 8, 12, tzinfo=UTC)
    assert parse_when("2026-01-15T09:00", now) == datetime(2026, 1, 15, 9, tzinfo=UTC)
    assert parse_when("2026-01-15T09:00+01:00", now).hour == 9
    with pytest.raises(SpillwayError, match="neither an ISO 8601 time nor an age"):
        parse_when("yesterday", now)


def test_status_filters_take_codes_classes_and_words() -> None:
    assert StatusFilter(()).holds(503)
    assert StatusFilter(("5xx",)).holds(503)
    assert not StatusFilter(("5xx",)).holds(429)
    assert StatusFilter(("200", "4xx")).holds(429)
    assert StatusFilter(("error",)).holds(400)
    assert not StatusFilter(("ok",)).holds(400)
    with pytest.raises(SpillwayError):
        StatusFilter(("7xx",))


def test_keys_sort_by_hour_and_listing_starts_at_the_hour_asked_for() -> None:
    area = Area.of("s3://bucket/capture", "acme")
    written = datetime(2026, 1, 15, 12, 30, 5, tzinfo=UTC)
    key = area.object_key("digits", "2026/01/15/12", written, "abc")
    assert key == f"{area.prefix}digits/2026/01/15/12/20260115T123005Z-abc.jsonl.gz"
    assert area.key_hour(key, "digits") == datetime(2026, 1, 15, 12, tzinfo=UTC)
    assert area.key_hour(key, "minilm") is None
    start = area.start_after("digits", datetime(2026, 1, 15, 12, 59, tzinfo=UTC))
    assert start is not None
    earlier = area.object_key("digits", "2026/01/15/11", written, "zzz")
    assert earlier < start < key
