"""A dynamic batcher: one per model version, one owner task, a bounded queue.

A batch is dispatched when enough rows wait (the target: ``min_batch_size``, else the
largest preferred size, else ``max_batch_size``; or the adaptive target), or when its
**oldest** request has waited ``max_queue_delay`` since it arrived (monotonic clock), or
at once while draining. Requests arrive validated and prepared, so a bad request never
joins a batch. Each request's future gets exactly its own rows; a failed run delivers
one error to every request of that batch and to no other.

Early dispatch (``policy.early_dispatch``): waiting is only worth it while it can gain a
row, so a batch below its target goes as soon as a compute slot is free and

* no request announced by ``incoming()`` (being read or tokenised) is on its way, and
* either every request the recent traffic brought at once is already in hand (queued or
  computing: a closed group of clients has nobody left to send), or the p50 arrival rate
  no longer expects one more request before the delay ends (``rate × time left < 1``).

A lone client therefore never waits out the delay, while under load the queue still
fills to the target: the seed rule ``target = max(2, p50 rate × delay)`` of the adaptive
mode is the same rate read the other way round.

Priority: level 1 is the highest. A request that has waited ``aging_s`` is taken before
any fresher request whatever its level, which bounds how long low priority can starve.
Fair share (``policy.fair_share``): among the requests that may go next (aged, or of the
best level waiting), the tenant served least lately goes first (``gpu_service.fair_share``:
each request carries its tenant's scope), else the oldest request; a tenant's own
requests keep their order.
Length buckets: requests queue by length bucket and a batch never mixes buckets, so short
texts never pad to long ones.
The length is whatever the model's processor buckets by (``Prepared.length``): tokens for
text, the padded width for variable-width images, so crops of similar width from many
requests batch together at one shape.

Compute: a bucket with a batch due claims slots of the device's compute budget through
the batcher's ``gpu_service.batch_seat.Seat``, and its batch forms when they are granted,
so requests wait here, where they can still join the batch, rather than on the CPU. Of
the buckets due, the one with the best ``Turn`` goes (the earliest deadline). A bucket
runs at most ``policy.concurrency`` batches at once. A request whose deadline the
expected wait already passes is refused at admission (429 ``deadline_unmeetable``).

The queue the batcher holds is ``gpu_service.batch_queue``; a formed batch computes
through ``gpu_service.batch_compute``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor

from gpu_service.batch_compute import Computed, Runner, run_batch
from gpu_service.batch_queue import Bucket, Level, Pending, State
from gpu_service.batch_seat import Seat
from gpu_service.batching_policy import BatchingPolicy, RateTracker
from gpu_service.compute_budget import ComputeBudget, Grant
from gpu_service.fair_share import FairShare, Scope
from gpu_service.stats import ModelStats
from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import (
    DeadlineExceededError,
    InferenceError,
    InvalidInputError,
    OverloadedError,
    SpillwayError,
    UnavailableError,
)

log = logging.getLogger("spillway.batcher")


class DynamicBatcher:
    """Queues prepared requests and runs them in batches on an executor.

    ``clock`` is the one time source for arrivals, delays, deadlines, statistics and the
    tenants' fair share; the loop's timers only wake the batcher, which then decides by
    ``clock``. On a virtual-time loop, pass the loop's ``time`` and the test controls every
    wait. ``share`` is the tenants' usage the batcher charges and orders by (its own when
    none is given; one shared by several batchers shares their compute). ``budget`` is
    the device's compute budget (none: one of its own, as if the model were alone on the
    device, ``policy.concurrency`` runs per bucket); ``executor``, when given, computes
    the runs instead of the budget's threads (tests run them inline).
    """

    def __init__(
        self,
        name: str,
        runner: Runner,
        policy: BatchingPolicy,
        executor: Executor | None = None,
        *,
        stats: ModelStats | None = None,
        clock: Callable[[], float] = time.monotonic,
        share: FairShare | None = None,
        budget: ComputeBudget | None = None,
    ) -> None:
        self.name = name
        self.runner = runner
        self.policy = policy
        self.stats = stats or ModelStats()
        self.failure: BaseException | None = None
        buckets = len(policy.length_buckets) + 1
        self._own_budget = budget is None
        self.budget = budget or ComputeBudget(
            policy.max_parallel_runs, overdraft=0, steps=False, clock=clock
        )
        self._executor = executor
        self._clock = clock
        self.share = share or FairShare(policy.fair_share_half_life_s)
        self._buckets = [
            Bucket(b, [Level() for _ in range(policy.priority_levels)]) for b in range(buckets)
        ]
        self.seat = Seat(name, policy, self.budget, self._buckets, self._due_now, self._wake)
        self.seat.widens = bool(getattr(runner, "wide", False))  # OnnxModel.wide
        self._admitted = itertools.count()
        self._queued = 0
        self._running = 0
        self._running_requests = 0
        self._upstream = 0
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._rate = RateTracker()
        self._stopping = False

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the owner task on the running loop."""
        self.budget.register(self.seat)
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name=f"batcher-{self.name}")
        self._task.add_done_callback(self._on_loop_done)

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting; finish queued and running work within the timeout; then end."""
        self._stopping = True
        self._wake()
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=drain_timeout_s)
            self._task.cancel()
        self._fail_queued(UnavailableError(f"model {self.name} is shutting down"))
        self._leave_budget()

    def _leave_budget(self) -> None:
        self.budget.withdraw(self.seat)
        self.seat.give_back()
        if self._own_budget:
            self.budget.close()

    @property
    def healthy(self) -> bool:
        """True while the owner task runs and the batcher admits requests."""
        return self._task is not None and not self._task.done() and not self._stopping

    @property
    def queue_depth(self) -> int:
        """Requests admitted and not yet dispatched."""
        return self._queued

    @property
    def running(self) -> int:
        """Batches being computed now."""
        return self._running

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        return self._queued == 0 and self._running == 0

    def busy_fraction(self) -> float:
        """Share of the recent window spent computing."""
        return self.stats.busy.fraction(self._clock())

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self.failure = task.exception()
        log.error(
            "batcher of %s died; failing its queued requests", self.name, exc_info=self.failure
        )
        self._fail_queued(UnavailableError(f"the batcher of model {self.name} failed"))
        self._leave_budget()

    def _fail_queued(self, error: SpillwayError) -> None:
        for bucket in self._buckets:
            for level in bucket.levels:
                for pending in level.drain():
                    if pending.state is State.QUEUED:
                        pending.state = State.LEFT
                        pending.settle(error=error)
            bucket.rows = 0
        self._queued = 0

    # -- admission -------------------------------------------------------------------------

    @contextlib.contextmanager
    def incoming(self) -> Iterator[None]:
        """Announce a request that is on its way (being tokenised, say) for as long as the
        block runs: early dispatch keeps a batch open for it, up to the delay."""
        self._upstream += 1
        try:
            yield
        finally:
            self._upstream -= 1
            self._wake()

    async def submit(
        self,
        prepared: Prepared,
        *,
        priority: int = 0,
        timeout_s: float | None = None,
        scope: Scope = None,
    ) -> Tensors:
        """Queue one prepared request of tenant ``scope``; its rows, or its error."""
        computed = await self.submit_timed(
            prepared, priority=priority, timeout_s=timeout_s, scope=scope
        )
        return computed.tensors

    async def submit_timed(
        self,
        prepared: Prepared,
        *,
        priority: int = 0,
        timeout_s: float | None = None,
        scope: Scope = None,
    ) -> Computed:
        """``submit``, with the request's queue and compute times for its statistics
        (the batcher counts executions; each request is counted by whoever answers it)."""
        pending = self._admit(prepared, priority, timeout_s, scope)
        try:
            return await pending.future
        finally:
            if pending.state is State.QUEUED:  # the caller went away: never compute it
                self._leave(pending)

    def _admit(
        self, prepared: Prepared, priority: int, timeout_s: float | None, scope: Scope
    ) -> Pending:
        policy = self.policy
        if not self.healthy:
            raise UnavailableError(f"model {self.name} is not serving")
        if prepared.rows > policy.max_batch_size:
            raise InvalidInputError(f"batch of {prepared.rows} exceeds {policy.max_batch_size}")
        level = policy.level_of(priority)
        timeout_s = policy.timeout_of(timeout_s)
        if self._queued >= policy.max_queue_size:
            self.stats.rejected += 1
            raise OverloadedError(
                f"model {self.name} queue is full ({policy.max_queue_size})",
                retry_after_s=policy.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        now = self._clock()
        bucket = policy.bucket_of(prepared.length)
        if timeout_s is not None:
            try:
                self.seat.shed_if_late(prepared.rows, bucket, now, timeout_s)
            except OverloadedError:
                self.stats.rejected += 1
                raise
        pending = Pending(
            prepared, level, now, bucket, loop.create_future(), scope, next(self._admitted)
        )
        if timeout_s is not None:
            pending.deadline = now + timeout_s
            pending.timer = loop.call_later(timeout_s, self._expire, pending)
        self._buckets[bucket].levels[level].append(pending)
        self._buckets[bucket].rows += prepared.rows
        self._queued += 1
        self._rate.arrive(now, self._upstream + self._queued + self._running_requests)
        self._wake()
        return pending

    def _expire(self, pending: Pending) -> None:
        if pending.state is not State.QUEUED or pending.deadline is None:
            return
        left = pending.deadline - self._clock()
        if left > 0:  # the loop's timer ran ahead of the clock (uvloop rounds to ms)
            pending.timer = asyncio.get_running_loop().call_later(left, self._expire, pending)
            return
        self._time_out(pending)

    def _time_out(self, pending: Pending) -> None:
        """A queued request's deadline passed: it leaves with 504, never computed."""
        waited = self._clock() - pending.arrival
        self._leave(pending)
        self.stats.expired += 1
        pending.settle(
            error=DeadlineExceededError(
                f"deadline passed after {waited * 1e3:.1f} ms in the queue of {self.name}"
            ),
        )

    def _leave(self, pending: Pending) -> None:
        """A queued request leaves without running (expired or cancelled)."""
        pending.state = State.LEFT
        if pending.timer is not None:
            pending.timer.cancel()
        self._buckets[pending.bucket].rows -= pending.prepared.rows
        self._queued -= 1
        self._wake()

    # -- dispatch --------------------------------------------------------------------------

    def _wake(self) -> None:
        """Make the owner task look again (state changed); cheap when it is not waiting."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not (self._stopping and self._queued == 0 and self._running == 0):
            due: list[Bucket] = []
            wait: float | None = None  # None: nothing comes due by itself; wait to be woken
            if self._queued:
                due, wait = self._due()
                if due and (grant := self.seat.take()) is not None:
                    bucket = min(due, key=self.seat.bucket_turn)
                    if batch := self._form(bucket):  # empty: every head had expired
                        self._dispatch(bucket, batch, grant)
                    else:
                        self.budget.release(grant)
                    continue
            if not due:  # a grant that came meanwhile has nothing to run now
                self.seat.give_back()
            # A future and a timer, not wait_for: this runs once per batch or arrival.
            self._waiter = waiter = loop.create_future()
            timer = None if wait is None else loop.call_later(wait, _resolve, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()

    def _target(self) -> int:
        policy = self.policy
        if policy.adaptive:
            expected = round(self._rate.p50_rate() * policy.max_queue_delay_s)
            return max(2, min(policy.max_batch_size, expected))
        if policy.min_batch_size is not None:
            return policy.min_batch_size
        return max(policy.preferred_batch_sizes, default=policy.max_batch_size)

    def _due(self) -> tuple[list[Bucket], float | None]:
        """The buckets with a batch due now, and the seconds until the next other bucket
        comes due (None: none will by itself); a bucket running ``policy.concurrency``
        batches is neither."""
        now, target = self._clock(), self._target()
        due: list[Bucket] = []
        later: float | None = None
        for bucket in self._buckets:
            heads = bucket.heads()
            if not heads or bucket.running >= self.policy.concurrency:
                continue
            if bucket.rows >= target or self._stopping:
                wait = 0.0
            else:
                oldest = min(h.arrival for h in heads)
                wait = oldest + self.policy.max_queue_delay_s - now
                if self.policy.early_dispatch:
                    wait = min(wait, self._company_due(wait, now))
            if wait <= _DUE_S:
                due.append(bucket)
            elif later is None or wait < later:
                later = wait
        return due, later

    def _due_now(self) -> list[Bucket]:
        return self._due()[0] if self._queued else []

    def _company_due(self, left: float, now: float) -> float:
        """Seconds until waiting for company stops paying (<= 0: now), with ``left``
        seconds of the delay to go; the rule is in the module docstring."""
        if self._upstream:
            return left
        if self._rate.crowd(now) <= self._queued + self._running_requests:
            return 0.0
        rate = self._rate.p50_rate()
        return left - 1.0 / rate if rate > 0 else 0.0

    def _form(self, bucket: Bucket) -> list[Pending]:
        """One batch from a bucket: aged requests first, then by priority; within those,
        the tenant served least lately first (fair share), else the oldest."""
        limit, now = self.policy.max_batch_size, self._clock()
        batch: list[Pending] = []
        rows = 0
        taken: dict[Scope, float] = {}
        while heads := bucket.heads():
            head = self._next(heads, now, taken)
            if rows + head.prepared.rows > limit:
                break
            if added := self._take(bucket, head, batch):
                rows += added
                taken[head.scope] = taken.get(head.scope, 0.0) + added
            if batch and not self.policy.merge:
                break
        for scope, amount in taken.items():
            self.share.charge(scope, amount, now)
        return self._claim(batch)

    def _next(self, heads: list[Pending], now: float, taken: dict[Scope, float]) -> Pending:
        """The request to take next: of the best rank (aged, else its level), the one
        whose tenant the fair share puts first, else (or on a tie) the oldest."""

        def rank(head: Pending) -> int:
            return 0 if now - head.arrival >= self.policy.aging_s else 1 + head.level

        best = min(rank(h) for h in heads)
        ready = [h for h in heads if rank(h) == best]
        if not self.policy.fair_share:
            return min(ready, key=lambda h: h.seq)
        return min(ready, key=lambda h: (self.share.rank(h.scope, now, taken), h.seq))

    def _take(self, bucket: Bucket, head: Pending, batch: list[Pending]) -> int:
        if head.deadline is not None and self._clock() >= head.deadline:
            # Due and its timer not run yet (it fires in this loop turn): an early
            # dispatch must not compute it either.
            self._time_out(head)
            return 0
        bucket.levels[head.level].pop(head)
        bucket.rows -= head.prepared.rows
        head.state = State.RUNNING
        if head.timer is not None:
            head.timer.cancel()
        batch.append(head)
        return head.prepared.rows

    def _claim(self, batch: list[Pending]) -> list[Pending]:
        self._queued -= len(batch)
        return batch

    def _dispatch(self, bucket: Bucket, batch: list[Pending], grant: Grant) -> None:
        self._running += 1
        self._running_requests += len(batch)
        bucket.running += 1
        task = asyncio.get_running_loop().create_task(self._execute(bucket, batch, grant))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _execute(self, bucket: Bucket, batch: list[Pending], grant: Grant) -> None:
        started = self._clock()
        self.stats.busy.start(started)
        rows = sum(p.prepared.rows for p in batch)
        self.seat.started(grant, bucket, rows)
        try:
            outcome = await run_batch(
                self.runner,
                self._executor or self.budget.executor(grant),
                [p.prepared for p in batch],
                self.name,
                wide=grant.wide,
                links=[p.link for p in batch],
            )
        finally:
            self.seat.ended(grant)
            self._running -= 1
            self._running_requests -= len(batch)
            bucket.running -= 1
            self._wake()
        if not isinstance(outcome, SpillwayError):
            bucket.measured(rows, self._clock() - started)
        try:
            self._finish(batch, started, outcome)
        except Exception as exc:
            # A bug in accounting must not leave the batch's callers waiting for ever.
            log.exception("settling a batch of %d requests for %s failed", len(batch), self.name)
            failure = InferenceError(f"inference failed on model {self.name}: {exc}")
            for pending in batch:
                pending.settle(error=failure)

    def _finish(
        self, batch: list[Pending], started: float, outcome: list[Tensors] | SpillwayError
    ) -> None:
        ended = self._clock()
        self.stats.busy.stop(ended)
        rows = sum(p.prepared.rows for p in batch)
        self.stats.record_batch(rows, ended - started, ok=not isinstance(outcome, SpillwayError))
        for index, pending in enumerate(batch):
            if isinstance(outcome, SpillwayError):
                pending.settle(error=outcome)
            else:
                computed = Computed(outcome[index], started - pending.arrival, ended - started)
                pending.settle(result=computed)


_DUE_S = 1e-6
"""A batch due within a microsecond is due now: far below any timer's resolution, and
a sum of floats (arrival + delay - 1/rate) never waits on a timer that cannot advance."""


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
