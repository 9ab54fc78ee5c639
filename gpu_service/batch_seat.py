"""A batcher's seat at the device's compute budget: how it claims slots, in which turn,
and what its queue is expected to cost.

The batcher (``gpu_service.batcher``) decides what is due and forms batches; its
``Seat`` is the ``Claimant`` the budget (``gpu_service.compute_budget``) sees: the turn
of its most urgent due bucket, the expected time of its next run, the slot-seconds of its
queue ahead of another turn, and the grants it holds. It also refuses, at admission, a
request whose deadline the expected wait already passes, and runs a request's CPU steps
(preparing it) on the budget's slots in that request's turn.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from gpu_service.batch_queue import Bucket
from gpu_service.batching_policy import BatchingPolicy
from gpu_service.compute_budget import ComputeBudget, Grant, Turn
from spillway import inference
from spillway.protocol.errors import DeadlineUnmeetableError

T = TypeVar("T")


@dataclass(eq=False)
class Seat:
    """One batcher's claims on ``budget``. ``due`` lists the buckets with a batch due now;
    ``wake`` makes the batcher look again (a grant came)."""

    name: str
    policy: BatchingPolicy
    budget: ComputeBudget
    buckets: list[Bucket]
    due: Callable[[], list[Bucket]]
    wake: Callable[[], None]
    widens: bool = False
    """Whether its model's runs can compute on every slot's threads (a wide session)."""
    grants: list[Grant] = field(default_factory=list)
    running: dict[Grant, int] = field(default_factory=dict)
    """The grants of the batches computing now, and their buckets."""

    # -- the budget's claimant -------------------------------------------------------------

    @property
    def slots_per_run(self) -> int:
        """Slots of the device's budget one run holds (``spillway.compute.slots``)."""
        return self.policy.slots_per_run

    def turn(self) -> Turn | None:
        """The most urgent due bucket's turn (None: no batch is due)."""
        return min((self.bucket_turn(b) for b in self.due()), default=None)

    def expected_run_s(self) -> float:
        """The next run's expected time: the rows the most urgent due bucket would take,
        at its measured seconds per row (0 before its first run)."""
        due = self.due()
        if not due:
            return 0.0
        bucket = min(due, key=self.bucket_turn)
        return min(bucket.rows, self.policy.max_batch_size) * bucket.row_s

    def expected_row_s(self) -> float:
        """The most urgent due bucket's measured seconds per row (0: none due, or not
        measured yet)."""
        due = self.due()
        return min(due, key=self.bucket_turn).row_s if due else 0.0

    def granted(self, grant: Grant) -> None:
        """The budget's grant for the next run: the batcher forms the batch."""
        self.grants.append(grant)
        self.wake()

    def work_ahead(self, turn: Turn) -> float:
        """Slot-seconds of the queued requests whose turn comes before ``turn``."""
        level = self.policy.compute_level
        if turn.level < level:
            return 0.0
        if turn.level > level:
            return self.queued_work()
        ahead = sum(b.work_before(turn, level, self.policy.horizon_s) for b in self.buckets)
        return ahead * self.policy.slots_per_run

    def queued_work(self) -> float:
        """Slot-seconds of every queued request, at the measured seconds per row."""
        return sum(b.rows * b.row_s for b in self.buckets) * self.policy.slots_per_run

    def queued(self) -> bool:
        """Whether a request of its waits."""
        return any(b.rows for b in self.buckets)

    def alone(self) -> bool:
        """Whether its next batch takes every request it holds (one bucket's, within a
        batch): nothing of its own would wait behind a run that took the whole device."""
        holding = [b for b in self.buckets if b.rows]
        return len(holding) <= 1 and sum(b.rows for b in holding) <= self.policy.max_batch_size

    # -- the batcher's side ----------------------------------------------------------------

    def bucket_turn(self, bucket: Bucket) -> Turn:
        """A bucket's turn (it must have a request queued)."""
        return bucket.turn(self.policy.compute_level, self.policy.horizon_s)

    def take(self) -> Grant | None:
        """Slots for the next run: a grant that came while the batcher waited, else one
        the budget gives now (None: the batcher waits its turn; ``granted`` wakes it)."""
        return self.grants.pop() if self.grants else self.budget.claim(self)

    def give_back(self) -> None:
        """Release the grants held unused (nothing is due any more)."""
        while self.grants:
            self.budget.release(self.grants.pop())

    def started(self, grant: Grant, bucket: Bucket, rows: int) -> None:
        """A batch of ``rows`` of ``bucket`` starts computing on ``grant``."""
        self.running[grant] = bucket.index
        per_run = self.policy.slots_per_run
        self.budget.running(grant, rows * bucket.row_s * per_run, bucket.row_s * per_run)

    def ended(self, grant: Grant) -> None:
        """That batch is done: its slots go back to the budget."""
        self.running.pop(grant, None)
        self.budget.release(grant)

    def shed_if_late(self, rows: int, bucket: int, now: float, timeout_s: float) -> None:
        """Refuse a request whose deadline its expected wait for the device, plus its own
        run, already passes: it fails now (429 ``deadline_unmeetable``, that wait as its
        ``Retry-After``) instead of timing out after holding a place, and the router
        tries the next backend at once."""
        own = rows * self.buckets[bucket].row_s * self.policy.slots_per_run
        wait = self.expected_wait(bucket, now, timeout_s, fits=timeout_s - own)
        if wait + own <= timeout_s:
            return
        raise DeadlineUnmeetableError(
            f"model {self.name} cannot answer within the request's {timeout_s * 1e3:.0f} ms: "
            f"the device's queue ahead of it is expected to take {wait * 1e3:.0f} ms",
            retry_after_s=max(self.policy.retry_after_s, float(math.ceil(wait))),
        )

    def expected_wait(
        self, bucket: int, now: float, timeout_s: float, *, fits: float | None = None
    ) -> float:
        """How long a request of ``bucket`` arriving ``now`` with ``timeout_s`` is expected
        to wait for the device: behind everything its bucket holds (a model's queue keeps
        its own order), its other buckets' work of an earlier turn, and the other
        models' work of an earlier turn (``ComputeBudget.expected_wait``)."""
        level, horizon, per_run = (
            self.policy.compute_level,
            self.policy.horizon_s,
            self.policy.slots_per_run,
        )
        turn = Turn(level, now + timeout_s, now)
        own = self.buckets[bucket]
        mine = own.rows * own.row_s + sum(
            b.work_before(turn, level, horizon) for b in self.buckets if b is not own
        )
        device = self.budget.expected_wait(turn, self, mine * per_run, fits=fits)
        # Its bucket runs at most `concurrency` batches at once, however many slots.
        lanes = max(1, min(self.policy.concurrency, self.budget.slots // per_run))
        at = self.budget.clock()
        going = sum(g.remaining(at) for g, b in self.running.items() if b == bucket)
        return max(device, (going + own.rows * own.row_s) / lanes)

    def offload_steps(
        self, offload: inference.Offload, arrived: float, timeout_s: float | None
    ) -> inference.Offload:
        """Where one request's CPU steps (preparing it) run: on a slot of the budget in the
        request's turn where the budget counts CPU steps (a CPU host), else on
        ``offload``. ``arrived`` is the request's ``time.perf_counter()`` arrival; with no
        ``timeout_s`` its turn counts one ``horizon_s`` after it."""
        if not self.budget.steps:
            return offload
        now = self.budget.clock()
        arrival = now - (time.perf_counter() - arrived)
        deadline = arrival + self.policy.horizon_s if timeout_s is None else now + timeout_s
        turn = Turn(self.policy.compute_level, deadline, arrival)

        async def on_budget(function: Callable[..., T], *args: object) -> T:
            return await self.budget.run_step(turn, function, *args)

        return on_budget
