"""The capture buffer and writer: bounded in bytes (batches being written included), due
by size or age on an injected clock, one object per tenant, model and hour, failed
writes retried then dropped, drops counted and reported as ``CaptureDropped``."""

from __future__ import annotations

import gzip
import io
import json
from datetime import UTC, datetime

import pytest

from spillway.capture.buffer import CaptureBuffer, Group
from spillway.capture.layout import Area, hour_of
from spillway.capture.records import Captured, captured
from spillway.capture.writer import CaptureWriter, s3_put
from spillway.policy.accounting import EmfSink
from spillway.policy.rules import CaptureRule
from spillway.state.table import scope
from tests.unit.capture_support import Clock, MemoryS3, routed

WHEN = datetime(2026, 1, 15, 12, 30, 5, tzinfo=UTC)
ROOT = "s3://bucket/capture"


def _item(tenant: str | None = "acme", body: bytes | None = None) -> Captured:
    made = routed(tenant=tenant) if body is None else routed(tenant=tenant, body=body)
    return captured(
        made, CaptureRule(sample=1), at=WHEN, record_id=f"id-{tenant}", max_body_bytes=10**6
    )


def _group(tenant: str | None = "acme", model: str = "digits") -> Group:
    return Group(scope(tenant), model, hour_of(WHEN))


def _buffer(clock: Clock, **kw: float) -> CaptureBuffer:
    options = {"max_bytes": 100_000, "flush_bytes": 50_000, "flush_s": 60.0, **kw}
    return CaptureBuffer(
        max_bytes=int(options["max_bytes"]),
        flush_bytes=int(options["flush_bytes"]),
        flush_s=options["flush_s"],
        clock=clock,
    )


def test_the_buffer_never_holds_more_than_its_bound_and_counts_what_it_drops() -> None:
    # GIVEN a buffer of 10 kB and records of about 1.6 kB
    buffer = _buffer(Clock(), max_bytes=10_000)
    item = _item()
    # WHEN 20 records are offered
    taken = [buffer.offer(_group(), item) for _ in range(20)]
    # THEN it takes what fits, drops the rest (counted), and never passes its bound
    fits = 10_000 // item.size
    assert taken == [True] * fits + [False] * (20 - fits)
    assert buffer.bytes == fits * item.size <= 10_000
    assert (buffer.accepted, buffer.dropped) == (fits, 20 - fits)
    assert buffer.take_dropped() == 20 - fits
    assert buffer.take_dropped() == 0  # reported once


def test_batches_being_written_count_against_the_bound_until_done() -> None:
    buffer = _buffer(Clock(), max_bytes=10_000)
    item = _item()
    while buffer.offer(_group(), item):
        pass
    [batch] = buffer.take_due(everything=True)
    # WHILE the batch is being written, its bytes are still held: nothing new fits
    assert not buffer.offer(_group(), item)
    buffer.done(batch)
    assert buffer.bytes == 0
    assert buffer.offer(_group(), item)


def test_a_group_is_due_by_age_on_the_injected_clock() -> None:
    clock = Clock()
    buffer = _buffer(clock, flush_s=60.0)
    buffer.offer(_group(), _item())
    clock.now += 30
    buffer.offer(_group("globex"), _item("globex"))
    assert not buffer.due()
    assert buffer.take_due() == []
    assert buffer.next_due_in() == pytest.approx(30.0)
    # WHEN the first group has waited 60 s THEN it alone is due
    clock.now += 30
    assert buffer.due()
    [batch] = buffer.take_due()
    assert batch.group == _group()
    assert buffer.next_due_in() == pytest.approx(30.0)


def test_a_group_is_due_once_it_holds_flush_bytes() -> None:
    buffer = _buffer(Clock(), flush_bytes=5_000)
    item = _item()
    for _ in range(5_000 // item.size):
        buffer.offer(_group(), item)
    assert not buffer.due()
    buffer.offer(_group(), item)
    assert buffer.due()
    assert buffer.next_due_in() == 0.0
    [batch] = buffer.take_due()
    assert len(batch.items) == 5_000 // item.size + 1


def test_records_are_grouped_per_tenant_model_and_hour() -> None:
    buffer = _buffer(Clock())
    for tenant in ("acme", "globex", None):
        buffer.offer(_group(tenant), _item(tenant))
    buffer.offer(_group("acme", "minilm"), _item("acme"))
    batches = buffer.take_due(everything=True)
    assert {(b.group.scope, b.group.model) for b in batches} == {
        (scope("acme"), "digits"),
        (scope("globex"), "digits"),
        ("-", "digits"),
        (scope("acme"), "minilm"),
    }


def test_a_batch_given_back_waits_and_is_dropped_after_its_last_try() -> None:
    clock = Clock()
    buffer = _buffer(clock, flush_bytes=1)  # every group is due at once
    buffer.offer(_group(), _item())
    for _attempt in (1, 2):
        [batch] = buffer.take_due()
        assert buffer.retry(batch)
        # THEN it is held back flush_s, however full
        assert buffer.take_due() == []
        clock.now += 60
    [batch] = buffer.take_due()
    assert batch.attempts == 2
    assert not buffer.retry(batch)  # the third failure drops it
    assert (buffer.bytes, buffer.dropped) == (0, 1)


# --- the writer -----------------------------------------------------------------------


def _writer(s3: MemoryS3, clock: Clock, metrics: io.StringIO, **kw: float) -> CaptureWriter:
    return CaptureWriter(_buffer(clock, **kw), ROOT, s3_put(s3), EmfSink(stream=metrics),
                         wall=lambda: WHEN)  # fmt: skip


def test_the_writer_puts_one_gzip_json_lines_object_per_tenant_area() -> None:
    s3, metrics = MemoryS3(), io.StringIO()
    writer = _writer(s3, Clock(), metrics)
    for tenant in ("acme", "acme", "globex"):
        writer.buffer.offer(_group(tenant), _item(tenant))
    assert writer.flush() == 3
    # THEN each tenant's records are one object in its own area, named by model and hour
    keys = sorted(key for _, key in s3.objects)
    acme, globex = Area.of(ROOT, "acme"), Area.of(ROOT, "globex")
    assert {bucket for bucket, _ in s3.objects} == {"bucket"}
    assert [k.startswith(acme.prefix + "digits/2026/01/15/12/") for k in keys].count(True) == 1
    assert [k.startswith(globex.prefix + "digits/2026/01/15/12/") for k in keys].count(True) == 1
    assert all(k.endswith(".jsonl.gz") and "/20260115T123005Z-" in k for k in keys)
    assert [r.tenant for r in s3.records(acme.prefix)] == ["acme", "acme"]
    assert [r.tenant for r in s3.records(globex.prefix)] == ["globex"]
    assert writer.buffer.bytes == 0
    assert (writer.written, writer.objects) == (3, 2)
    for body in s3.objects.values():
        for line in gzip.decompress(body).splitlines():
            json.loads(line)


def test_a_failed_put_is_retried_and_the_records_written_later() -> None:
    s3, metrics, clock = MemoryS3(fail=1), io.StringIO(), Clock()
    writer = _writer(s3, clock, metrics)
    writer.buffer.offer(_group(), _item())
    assert writer.flush() == 0
    assert writer.failures == 1
    assert writer.buffer.bytes > 0  # kept for the next try
    clock.now += 60
    assert writer.flush(everything=False) == 1
    assert len(s3.records()) == 1
    assert writer.buffer.bytes == 0


def test_drops_are_reported_once_as_a_capture_dropped_count() -> None:
    s3, metrics = MemoryS3(), io.StringIO()
    writer = _writer(s3, Clock(), metrics, max_bytes=2_000)
    for _ in range(5):
        writer.buffer.offer(_group(), _item())
    writer.flush()
    writer.flush()
    documents = [json.loads(line) for line in metrics.getvalue().splitlines()]
    dropped = [d["CaptureDropped"] for d in documents if "CaptureDropped" in d]
    assert dropped == [[4.0]]
    assert documents[0]["_aws"]["CloudWatchMetrics"][0]["Namespace"] == "Spillway"


def test_the_thread_writes_a_batch_once_it_is_due() -> None:
    s3, metrics = MemoryS3(), io.StringIO()
    writer = _writer(s3, Clock(), metrics, flush_bytes=1)
    writer.start()
    try:
        writer.buffer.offer(_group(), _item())
        writer.wake()
        from tests.fakes import eventually

        eventually(lambda: s3.objects, "the due batch written by the thread", timeout_s=10)
    finally:
        writer.close(timeout_s=5)
    assert len(s3.records()) == 1
