"""The capture writer: a background thread that writes the buffer's due batches to S3.

Each batch (one tenant's records of one model and hour) becomes one gzip JSON Lines object
in that tenant's area, put with one ``PutObject``. The thread wakes when a batch is due
(full, or its oldest record waited ``flush_s``) or when the watcher says one is; a failed
put gives the batch back to the buffer for a later try (three tries, then its records
are dropped and counted). The thread is the only one that encodes records or waits on S3:
a request's thread only ever adds to the buffer.

Drops (a full buffer, a batch given up) are logged and written as one EMF count,
``CaptureDropped``, through the router's metrics sink, at most once per flush round.

On Lambda the environment is frozen between invocations and its threads with it: a batch
that fell due while frozen is written as soon as the next invocation thaws it, and the
watcher wakes the thread when a request finds a batch due, so it runs while that
invocation lasts. What an environment holds when Lambda reclaims it (the records of its
last ``flush_s`` at most) is lost: docs/capture.md.
"""

from __future__ import annotations

import gzip
import logging
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from aws_lambda_powertools.metrics import EphemeralMetrics, MetricUnit

from spillway.capture.buffer import Batch, CaptureBuffer
from spillway.capture.layout import Area
from spillway.capture.records import record_of
from spillway.policy.accounting import NAMESPACE, SERVICE, EmfSink

log = logging.getLogger("spillway.capture")

Put = Callable[[str, str, bytes], None]
"""Writes one object: bucket, key, body."""
DROPPED_METRIC = "CaptureDropped"
WRITTEN_METRIC = "CaptureWritten"


def s3_put(client: Any) -> Put:
    """``PutObject`` with a boto3 S3 ``client`` (gzip JSON Lines)."""

    def put(bucket: str, key: str, body: bytes) -> None:
        client.put_object(
            Bucket=bucket,
            Key=key,
            Body=body,
            ContentType="application/x-ndjson",
            ContentEncoding="gzip",
        )

    return put


def s3_client() -> Any:
    """The S3 client capture writes with: short timeouts and two tries, so a stalled S3
    holds the writer for seconds, never the requests (they only fill the buffer)."""
    from spillway.aws.clients import client

    return client("s3", connect_timeout=2, read_timeout=5, max_attempts=2)


def count_metric(name: str, count: int) -> dict[str, object]:
    """An EMF count of ``count`` with only the service dimension."""
    metrics = EphemeralMetrics(namespace=NAMESPACE, service=SERVICE)
    metrics.add_metric(name, MetricUnit.Count, count)
    return dict(metrics.serialize_metric_set())


class CaptureWriter:
    """Writes the buffer's due batches, in its own daemon thread (``start``), or when
    asked (``flush``)."""

    def __init__(
        self,
        buffer: CaptureBuffer,
        root: str,
        put: Put,
        sink: EmfSink,
        *,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.buffer = buffer
        self.root = root
        self._put = put
        self._sink = sink
        self._wall = wall
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._writing = threading.Lock()
        self._thread: threading.Thread | None = None
        self.written = 0
        """Records written, ever."""
        self.objects = 0
        """Objects written, ever."""
        self.failures = 0
        """Puts that failed, ever."""

    def start(self) -> None:
        """Start the background thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spillway-capture", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Have the thread look at the buffer now (never waits)."""
        self._wake.set()

    def close(self, timeout_s: float = 10.0, *, write: bool = True) -> None:
        """Stop the thread (waiting ``timeout_s`` at most for its current put) and, with
        ``write``, write what the buffer holds; once (a second call does nothing)."""
        if self._stop.is_set():
            return  # closed already
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if write:
            self.flush(everything=True)

    def flush(self, *, everything: bool = True) -> int:
        """Write the due batches (every batch with ``everything``) now, on this thread;
        the records written."""
        with self._writing:
            return self._write(self.buffer.take_due(everything=everything))

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self.buffer.next_due_in()
            self._wake.wait(timeout=wait if wait is not None else None)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                with self._writing:
                    self._write(self.buffer.take_due())
            except Exception:
                log.exception("capture writer round failed")

    def _write(self, batches: list[Batch]) -> int:
        written = 0
        for batch in batches:
            if self._write_batch(batch):
                written += len(batch.items)
        self.report_drops()
        return written

    def _write_batch(self, batch: Batch) -> bool:
        group = batch.group
        lines = b"".join(record_of(item).line() for item in batch.items)
        body = gzip.compress(lines, compresslevel=6, mtime=0)
        where = Area.of(self.root, batch.items[0].tenant)
        key = where.object_key(group.model, group.hour, self._wall(), uuid.uuid4().hex)
        try:
            self._put(where.bucket, key, body)
        except Exception as exc:  # noqa: BLE001 - any client error: keep or drop, never raise
            self.failures += 1
            kept = self.buffer.retry(batch)
            log.warning(
                "capture write failed",
                extra={
                    "key": key,
                    "records": len(batch.items),
                    "kept_for_retry": kept,
                    "reason": str(exc)[:300],
                },
            )
            return False
        self.buffer.done(batch)
        self.written += len(batch.items)
        self.objects += 1
        return True

    def report_drops(self) -> None:
        """Log and count (``CaptureDropped``) the drops not reported yet."""
        dropped = self.buffer.take_dropped()
        if dropped:
            log.warning(
                "capture dropped records",
                extra={"dropped": dropped, "dropped_total": self.buffer.dropped},
            )
            self._sink.write(count_metric(DROPPED_METRIC, dropped))
