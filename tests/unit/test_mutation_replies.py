"""What the mutation run of spillway/protocol/replies.py found unchecked (docs/mutation.md):
the one log line of a refused request and of an unexpected exception, with their fields,
and the reason phrase of a status HTTP does not name."""

from __future__ import annotations

import logging

import pytest

from spillway.protocol.errors import ModelNotFoundError
from spillway.protocol.replies import (
    INTERNAL_ERROR,
    Reply,
    error_reply,
    guarded,
    status_phrase,
)

LOG = logging.getLogger("spillway.test.replies")


@pytest.mark.parametrize(
    ("status", "phrase"), [(200, "OK"), (404, "Not Found"), (299, "Unknown"), (599, "Unknown")]
)
def test_every_status_has_a_phrase(status: int, phrase: str) -> None:
    assert status_phrase(status) == phrase


def test_a_refusal_is_logged_once_at_info_with_where_and_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = ModelNotFoundError("no model nope")

    def answer() -> Reply:
        raise error

    with caplog.at_level(logging.INFO, logger=LOG.name):
        reply = guarded(LOG, answer, method="POST", path="/v2/models/nope/infer")
    assert reply == error_reply(error)
    [record] = caplog.records
    assert (record.levelno, record.getMessage()) == (logging.INFO, "refused")
    fields = {k: getattr(record, k, None) for k in ("method", "path", "status", "code", "reason")}
    assert fields == {
        "method": "POST",
        "path": "/v2/models/nope/infer",
        "status": error.status,
        "code": error.code,
        "reason": "no model nope",
    }


def test_an_unexpected_exception_is_logged_with_its_traceback_and_where(
    caplog: pytest.LogCaptureFixture,
) -> None:
    crash = RuntimeError("bug")

    def answer() -> Reply:
        raise crash

    with caplog.at_level(logging.INFO, logger=LOG.name):
        reply = guarded(LOG, answer, method="GET", path="/metrics")
    assert reply is INTERNAL_ERROR
    [record] = caplog.records
    assert (record.levelno, record.getMessage()) == (logging.ERROR, "unhandled error")
    assert (getattr(record, "method", None), getattr(record, "path", None)) == ("GET", "/metrics")
    assert record.exc_info is not None
    assert record.exc_info[1] is crash
