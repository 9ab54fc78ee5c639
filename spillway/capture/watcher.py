"""The router's data-capture watcher: which requests are kept, and handing them on.

``Capture`` is the router's ``Watcher``: told of every request the router routed, it
keeps an inference request when the policy's first ``capture`` entry for its model and
tenant says so (a failed one only with ``errors``), drawing against the entry's
``sample`` rate, and offers the record to the buffer. That is all it does on the
request's thread: a few header reads, one random draw and a list append under a lock; no
encoding, no I/O. A full buffer drops the record and counts it; the drops are reported
(logged, ``CaptureDropped``) at most once a second from here, and by the writer after
each round.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from spillway.capture.buffer import CaptureBuffer, Group
from spillway.capture.layout import folder_of, hour_of
from spillway.capture.records import RoutedLike, captured
from spillway.capture.writer import CaptureWriter
from spillway.policy.rules import CaptureRule, Policy
from spillway.state.table import scope


class Capture:
    """Data capture for one router: the policy's ``capture`` section, the buffer and its
    writer."""

    def __init__(
        self,
        writer: CaptureWriter,
        policy: Callable[[], Policy],
        *,
        max_record_bytes: int,
        rng: random.Random | None = None,
        clock: Callable[[], float],
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
        report_every_s: float = 1.0,
    ) -> None:
        self.writer = writer
        self.buffer: CaptureBuffer = writer.buffer
        self._policy = policy
        self._rng = rng or random.Random()  # noqa: S311 - sampling draws, not secrets
        self._clock = clock
        self._wall = wall
        self.max_record_bytes = max_record_bytes
        self._report_every_s = report_every_s
        self._reported_at = clock()
        self._reporting = threading.Lock()

    def __call__(self, routed: RoutedLike) -> None:
        """Keep ``routed`` when the policy samples it; never waits."""
        rule = self.rule_for(routed)
        if rule is None or not self.sampled(rule):
            return
        at = self._wall()
        item = captured(
            routed,
            rule,
            at=at,
            record_id=str(uuid.uuid4()),
            max_body_bytes=self.max_record_bytes,
        )
        group = Group(scope(routed.tenant), folder_of(item.model, item.status), hour_of(at))
        if self.buffer.offer(group, item):
            if self.buffer.due():
                self.writer.wake()
        else:
            self._report_drops()

    def rule_for(self, routed: RoutedLike) -> CaptureRule | None:
        """The ``capture`` entry that decides for ``routed`` (``None``: not captured): only
        inference requests, a failed one only when the entry keeps ``errors``."""
        target = routed.target
        if target.operation != "infer" or target.model is None:
            return None
        rule = self._policy().capture_rule(target.model, routed.tenant)
        if rule is None or (routed.reply.status >= 400 and not rule.errors):
            return None
        return rule

    def sampled(self, rule: CaptureRule) -> bool:
        """One draw against ``rule.sample`` (none at 0 or 1)."""
        if rule.sample >= 1:
            return True
        return rule.sample > 0 and self._rng.random() < rule.sample

    def start(self) -> None:
        """Start the writer's thread."""
        self.writer.start()

    def flush(self) -> int:
        """Write every record held now (tests, shutdown); the records written."""
        return self.writer.flush(everything=True)

    def close(self, timeout_s: float = 10.0, *, write: bool = True) -> None:
        """Stop the writer's thread and (with ``write``) write what is held."""
        self.writer.close(timeout_s, write=write)

    def _report_drops(self) -> None:
        now = self._clock()
        if now - self._reported_at < self._report_every_s:
            return
        if self._reporting.acquire(blocking=False):
            try:
                self._reported_at = now
                self.writer.report_drops()
            finally:
                self._reporting.release()
