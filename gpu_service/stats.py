"""Per model-version statistics in Triton's shape, and the busy fraction.

Statistics are one snapshot, as Triton's are: a request's counters (``success``,
``queue``, ``compute_input``, ``compute_infer``, ``compute_output``) move together in one
synchronous call when its answer is ready (``ModelStats.record_success``), and a failed
request adds to ``fail`` only. Everything here runs on the service's event loop, where the
statistics and metrics endpoints read it, so every snapshot has those five counts equal:
the invariant Triton's perf_analyzer checks (it aborts with "Server side statistics
compute counts must be the same" when the differences of the compute counts between two
snapshots disagree, for a model and for each composing model of a pipeline).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

NS = 1_000_000_000
# Batch-size histogram buckets for /metrics.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class Counter:
    """A count and a total duration, as Triton's statistics report them."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * NS)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BusyTracker:
    """Fraction of recent wall time with at least one batch computing."""

    window_s: float = 10.0
    _active: int = 0
    _since: float = 0.0
    _total: float = 0.0
    _samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=4096))

    def _accumulate(self, now: float) -> float:
        if self._active:
            self._total += now - self._since
        self._since = now
        self._samples.append((now, self._total))
        return self._total

    def start(self, now: float) -> None:
        self._accumulate(now)
        self._active += 1

    def stop(self, now: float) -> None:
        self._accumulate(now)
        self._active = max(0, self._active - 1)

    def fraction(self, now: float) -> float:
        """Busy share of the last ``window_s`` seconds (0.0 to 1.0); O(1) amortised: samples
        older than the window are dropped as time passes (this runs on every response)."""
        total = self._total + ((now - self._since) if self._active else 0.0)
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        start_t, start_total = self._samples[0] if self._samples else (now, total)
        span = now - start_t
        if span <= 0:
            return 1.0 if self._active else 0.0
        return max(0.0, min(1.0, (total - start_total) / span))


@dataclass
class RequestTimer:
    """One request's way through a model version, marked on ``clock``; what
    ``ModelStats.record_success`` splits it into (Triton's split):

    * compute_input: arrival until it is queued (decoding, checks, preparing);
    * queue and compute_infer: the batcher's figures, its wait for a batch and that
      batch's whole run;
    * compute_output: the batch's answer until the request is done (encoding)."""

    arrived: float
    clock: Callable[[], float] = time.perf_counter
    queued: float = 0.0
    answered: float = 0.0
    queue_s: float = 0.0
    infer_s: float = 0.0

    def enqueued(self) -> None:
        """The request goes into the batcher now."""
        self.queued = self.clock()

    def computed(self, queue_s: float, infer_s: float) -> None:
        """Its rows came back now, after ``queue_s`` queued and a run of ``infer_s``."""
        self.answered = self.clock()
        self.queue_s, self.infer_s = queue_s, infer_s


@dataclass
class ModelStats:
    """Everything counted for one model version."""

    success: Counter = field(default_factory=Counter)
    fail: Counter = field(default_factory=Counter)
    queue: Counter = field(default_factory=Counter)
    compute_input: Counter = field(default_factory=Counter)
    compute_infer: Counter = field(default_factory=Counter)
    compute_output: Counter = field(default_factory=Counter)
    inference_count: int = 0
    execution_count: int = 0
    rejected: int = 0
    expired: int = 0
    last_inference_ms: int = 0
    batch_sizes: dict[int, Counter] = field(default_factory=dict)
    busy: BusyTracker = field(default_factory=BusyTracker)

    def record_batch(self, rows: int, seconds: float, *, ok: bool) -> None:
        """One run of the model over ``rows`` rows (an execution; its requests are counted
        each on its own when answered)."""
        self.execution_count += 1
        if ok:
            self.inference_count += rows
            self.last_inference_ms = int(time.time() * 1000)
        self.batch_sizes.setdefault(rows, Counter()).add(seconds)

    def record_success(self, timer: RequestTimer) -> None:
        """One request answered, done now: all its counters in this one step (no await
        between them), so no snapshot can see some and not the others."""
        done = timer.clock()
        self.success.add(done - timer.arrived)
        self.queue.add(timer.queue_s)
        self.compute_input.add(timer.queued - timer.arrived)
        self.compute_infer.add(timer.infer_s)
        self.compute_output.add(done - timer.answered)

    def record_failure(self, seconds: float) -> None:
        """One request failed after ``seconds``: ``fail`` only, as Triton counts it."""
        self.fail.add(seconds)

    def to_triton(self, name: str, version: str) -> dict[str, Any]:
        """The ``model_stats`` entry of Triton's statistics extension."""
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_dict(),
                "fail": self.fail.as_dict(),
                "queue": self.queue.as_dict(),
                "compute_input": self.compute_input.as_dict(),
                "compute_infer": self.compute_infer.as_dict(),
                "compute_output": self.compute_output.as_dict(),
                # Triton's response cache; none here (perf_analyzer reads the fields).
                "cache_hit": Counter().as_dict(),
                "cache_miss": Counter().as_dict(),
            },
            "batch_stats": [
                {"batch_size": size, "compute_infer": c.as_dict()}
                for size, c in sorted(self.batch_sizes.items())
            ],
            "spillway": {"rejected": self.rejected, "expired": self.expired},
        }
