"""One compute budget per device: every run of every model version and length bucket, and
every CPU-heavy step of a request on a CPU host, takes its slots from it.

Why one: a pool of compute threads per model version and per length bucket lets each
compute at once, so under load a pipeline's detector, classifier and every width bucket
of its recogniser (and the image steps between them) all run on the same few cores, each
slower than alone, and the light model beside them waits for whatever they leave. Here
the device has ``slots`` and a run starts only when it holds its share (Triton's rate
limiter: an instance runs when the resources it declares are free); until then its
requests wait in their batcher, where they can still grow into a bigger batch, instead of
on the CPU.

* **Sizing** (``GpuSettings.compute_layout``): on a CPU host one slot per core, each run
  computing on one ONNX Runtime thread, so runs never outnumber cores; on a GPU host two
  slots (the device serialises kernels anyway; one batch is formed and copied while
  another computes). A model declares what one run needs, ``spillway.compute.slots``
  (its session gets that many intra-op threads), and its priority level.
* **Order**: each claimant (a batcher with a batch due, or one request's CPU step) has a
  ``Turn``: its model's priority level (1 first), then the earliest deadline (a request
  without one counts from its arrival plus its model's latency budget), then arrival.
  A freed slot goes to the best turn waiting; a claim needing more slots than are free
  holds the ones behind it back, so a big claim is never starved by small ones.
* **Overdraft**: when every slot is held, a run may start on one of ``overdraft`` extra
  slots if it is expected to take at most ``short_run_s`` and its turn is better than
  that of everything holding a slot (a light model's run never waits behind a heavy
  one's), or if everything holding a slot computes a row ten times slower than it does
  (short texts never wait behind a batch of long ones). Either way it is light enough
  that the oversubscription it causes is too; work no more urgent and no lighter than
  what runs waits its turn.
* **Expected wait**: run times are measured per claimant (``Claimant.work_ahead``: rows
  times the measured seconds per row of their bucket), so the slot-seconds ahead of a
  turn, over the slots, estimate how long it will wait; a batcher refuses at admission a
  request whose deadline that wait already passes (``gpu_service.batcher``).

* **Wide runs**: a run that finds the device idle computes on every slot's threads (its
  model's second, wide session), still holding one slot, so one client is as quick as
  on a process of its own.

Everything runs on the service's event loop but the computing itself, which runs on the
budget's own threads (``executor``): short, wide and overdraft runs on ``slots +
overdraft`` threads at the service's priority, longer ones on ``slots`` threads at
``long_niceness``, however many models and buckets are loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

T = TypeVar("T")


def _renice(niceness: int) -> None:
    # Linux applies setpriority to one thread when given its thread id; raising a
    # thread's niceness needs no privilege (lowering it again would).
    if niceness and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


def limit_library_threads(threads: int) -> None:
    """Give OpenCV's own thread pool one slot's threads: an image step on a slot then uses
    that slot alone, where OpenCV would otherwise spread its resizes and warps over a
    thread per core beside every run (its default)."""
    if importlib.util.find_spec("cv2") is None:
        return
    cv2 = importlib.import_module("cv2")
    cv2.setNumThreads(threads)


_OVERDRAFT_RATIO = 10.0
"""A run overdraws when every run holding a slot computes a row this many times slower
(whatever its turn)."""


@dataclass(frozen=True, order=True)
class Turn:
    """Where a claim stands in the device's order: lower goes first."""

    level: int
    """The model's priority level (``spillway.compute.priority``; 1 first)."""
    deadline: float
    """The earliest deadline of the claim's work (the budget's clock)."""
    arrival: float
    """When its oldest request arrived."""


@dataclass(eq=False)
class Grant:
    """Slots held by one claimant for one run: released once, by the budget."""

    slots: int
    turn: Turn
    overdraft: bool = False
    wide: bool = False
    """It found the device idle: its run computes on every slot's threads (work that
    comes meanwhile still takes the other slots: for as long as both run, the cores have
    a thread more each)."""
    started: float | None = None
    expected_s: float = 0.0
    row_s: float = 0.0
    """The run's expected seconds per row (0: not known)."""
    released: bool = False

    def start(self, now: float, expected_s: float, row_s: float) -> None:
        """The run it holds begins now and is expected to take ``expected_s``, at
        ``row_s`` a row."""
        self.started, self.expected_s, self.row_s = now, expected_s, row_s

    def remaining(self, now: float) -> float:
        """Expected seconds until it frees (0 when not started or overdue)."""
        if self.started is None:
            return 0.0
        return max(0.0, self.expected_s - (now - self.started))


class Claimant(Protocol):
    """Who asks the budget for slots (a batcher; a one-off CPU step)."""

    @property
    def slots_per_run(self) -> int:
        """Slots one of its runs holds."""

    def turn(self) -> Turn | None:
        """Its most urgent work's turn now; None when it has nothing due any more."""

    def expected_run_s(self) -> float:
        """How long its next run is expected to take (0: not known yet)."""

    def expected_row_s(self) -> float:
        """Its next run's expected seconds per row (0: not known yet)."""

    def granted(self, grant: Grant) -> None:
        """The budget gives it ``grant``; it must run or release it."""

    def work_ahead(self, turn: Turn) -> float:
        """Slot-seconds of its queued work that goes before ``turn``."""

    def queued_work(self) -> float:
        """Slot-seconds of all its queued work (at least ``work_ahead`` of any turn)."""

    def queued(self) -> bool:
        """Whether it holds work that waits (measured or not)."""

    def alone(self) -> bool:
        """Whether its next run takes all the work it holds (none is left to wait)."""

    @property
    def widens(self) -> bool:
        """Whether its runs can compute on every slot's threads (a wide session)."""


@dataclass(eq=False)
class _Step:
    """A one-off claim: one CPU step of a request, run when its turn comes."""

    at: Turn
    future: asyncio.Future[Grant]
    slots_per_run: int = 1

    def turn(self) -> Turn | None:
        return None if self.future.done() else self.at

    def expected_run_s(self) -> float:
        return math.inf  # unmeasured: never overdraws

    def expected_row_s(self) -> float:
        return math.inf

    def granted(self, grant: Grant) -> None:
        self.future.set_result(grant)

    def work_ahead(self, turn: Turn) -> float:
        return 0.0

    def queued_work(self) -> float:
        return 0.0

    def queued(self) -> bool:
        return not self.future.done()

    def alone(self) -> bool:
        return False

    @property
    def widens(self) -> bool:
        return False  # a step computes on its own thread


@dataclass(eq=False)
class ComputeBudget:
    """A device's slots, the claims waiting for them and the threads runs compute on.

    ``clock`` is the one time source for turns, run times and estimates (inject one in
    tests). ``steps``: whether requests' CPU steps take slots too (a CPU host: they
    compete with runs for the same cores; on a GPU host they run on the parse threads).
    ``threads``: where runs and steps compute (none: the budget's own threads, one per
    slot and per overdraft slot). ``wide``: whether a run that finds the device idle (no
    slot held, nothing else waiting or queued, and nothing of its own left behind)
    computes on every slot's threads (the models have a wide session).
    """

    slots: int
    overdraft: int = 1
    short_run_s: float = 0.005
    steps: bool = True
    clock: Callable[[], float] = time.monotonic
    threads: Executor | None = None
    wide: bool = False
    in_use: int = 0
    overdrawn: int = 0
    peak: int = 0
    """Most runs and steps that held slots at once (overdraft included)."""
    _waiting: dict[Claimant, None] = field(default_factory=dict, repr=False)
    _claimants: dict[Claimant, None] = field(default_factory=dict, repr=False)
    _held: dict[Grant, None] = field(default_factory=dict, repr=False)
    """The grants holding slots (not the overdraft), runs and steps."""
    _step_s: dict[str, float] = field(default_factory=dict, repr=False)
    """Measured seconds of each kind of CPU step (a moving average)."""
    long_niceness: int = 10
    """OS niceness of the threads long runs and steps compute on (0: as the service)."""
    _pools: dict[bool, ThreadPoolExecutor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.slots < 1 or self.overdraft < 0:
            raise ValueError("a budget needs at least one slot and no negative overdraft")

    def executor(self, grant: Grant) -> Executor:
        """Where ``grant``'s run (or step) computes: a run expected to be short, a wide
        one, or one on an overdraft slot (it passed a lighter or more urgent claim's
        test), on the
        budget's threads at the service's own OS priority; a longer one on its threads
        at ``long_niceness``, so that on a busy CPU the event loop and the short runs get
        a core at once instead of after a scheduler slice of the long ones. Either kind
        has a thread for each run the budget may grant at once."""
        if self.threads is not None:
            return self.threads
        # A wide run computes on ONNX Runtime's own threads too, at the service's
        # priority: its calling thread must not be the one half of it left behind.
        long = grant.expected_s > self.short_run_s and not (grant.overdraft or grant.wide)
        pool = self._pools.get(long)
        if pool is None:
            size = self.slots + (0 if long else self.overdraft)
            niceness = self.long_niceness if long else 0
            pool = ThreadPoolExecutor(
                size,
                thread_name_prefix="compute-long" if long else "compute",
                initializer=_renice,
                initargs=(niceness,),
            )
            self._pools[long] = pool
        return pool

    @property
    def free(self) -> int:
        return self.slots - self.in_use

    def close(self) -> None:
        """Stop its own threads (after the batchers have drained)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False)

    # -- claimants -------------------------------------------------------------------------

    def register(self, claimant: Claimant) -> None:
        """Count ``claimant``'s queued work in the expected waits."""
        self._claimants[claimant] = None

    def withdraw(self, claimant: Claimant) -> None:
        """``claimant`` stops: no grant reaches it and its work no longer counts."""
        self._claimants.pop(claimant, None)
        self._waiting.pop(claimant, None)

    def claim(self, claimant: Claimant) -> Grant | None:
        """Slots for ``claimant``'s next run now, or None: it waits, and ``granted`` is
        called when its turn comes (asking again while waiting is harmless)."""
        turn = claimant.turn()
        if turn is None:
            return None
        need = min(claimant.slots_per_run, self.slots)
        if self._better_waiting(claimant, turn):
            self._waiting[claimant] = None
            return None
        if need <= self.free:
            self._waiting.pop(claimant, None)
            return self._take(need, turn, overdraft=False, wide=self._idle_for(claimant))
        if self._may_overdraw(claimant, turn):
            self._waiting.pop(claimant, None)
            return self._take(1, turn, overdraft=True)
        self._waiting[claimant] = None
        return None

    def release(self, grant: Grant) -> None:
        """A run (or a step) ended, or a grant was not needed: its slots go to the best
        waiting turns."""
        if grant.released:
            return
        grant.released = True
        self._held.pop(grant, None)
        if grant.overdraft:
            self.overdrawn -= 1
        else:
            self.in_use -= grant.slots
        self._grant_waiting()

    def running(self, grant: Grant, expected_s: float, row_s: float = 0.0) -> None:
        """``grant``'s run starts, expected to take ``expected_s`` seconds (``row_s`` a
        row)."""
        grant.start(self.clock(), expected_s, row_s)

    # -- CPU steps -------------------------------------------------------------------------

    async def run_step(self, at: Turn, function: Callable[..., T], *args: object) -> T:
        """Run one CPU step of a request (a page's decoding, say) on a slot when ``at``'s
        turn comes; the slot is the step's for as long as it runs."""
        loop = asyncio.get_running_loop()
        step = _Step(at, loop.create_future())
        grant = self.claim(step)
        name = getattr(function, "__qualname__", "step")
        try:
            if grant is None:
                grant = await step.future
            took_before = self._step_s.get(name, 0.0)
            self.running(grant, took_before, took_before)
            result = await loop.run_in_executor(self.executor(grant), function, *args)
            took = self.clock() - (grant.started or 0.0)
            known = self._step_s.get(name)
            self._step_s[name] = took if known is None else known + 0.2 * (took - known)
            return result
        finally:
            self._waiting.pop(step, None)
            if grant is not None:
                self.release(grant)
            elif step.future.done() and not step.future.cancelled():
                self.release(step.future.result())  # granted as the caller went away
            else:
                step.future.cancel()

    # -- estimates -------------------------------------------------------------------------

    def expected_wait(
        self, turn: Turn, mine: Claimant, ahead_of_mine: float, *, fits: float | None = None
    ) -> float:
        """Seconds a request of claimant ``mine`` in ``turn`` is expected to wait for a
        slot: the slot-seconds of the runs going now (what is left of them), of its own
        claimant's work ahead of it (``ahead_of_mine``: it knows its own queue's order)
        and of the others' queued work ahead of ``turn``, over the slots. With ``fits``:
        when even all the queued work would be done by then, that bound is returned
        without ordering the queues (the common case)."""
        now = self.clock()
        busy = sum(g.remaining(now) * g.slots for g in self._held)
        others = [c for c in self._claimants if c is not mine]
        if fits is not None:
            bound = (busy + ahead_of_mine + sum(c.queued_work() for c in others)) / self.slots
            if bound <= fits:
                return bound
        ahead = sum(c.work_ahead(turn) for c in others)
        return (busy + ahead_of_mine + ahead) / self.slots

    # -- inside ----------------------------------------------------------------------------

    def _idle_for(self, claimant: Claimant) -> bool:
        """Whether ``claimant``'s run may take the whole device: it is idle but for it."""
        if not (self.wide and claimant.widens) or self.in_use or not claimant.alone():
            return False
        others = (c for c in (*self._waiting, *self._claimants) if c is not claimant)
        return not any(c.queued() for c in others)

    def _take(self, need: int, turn: Turn, *, overdraft: bool, wide: bool = False) -> Grant:
        grant = Grant(need, turn, overdraft, wide)
        if overdraft:
            self.overdrawn += 1
        else:
            self.in_use += need
            self._held[grant] = None
        self.peak = max(self.peak, self.in_use + self.overdrawn)
        return grant

    def _better_waiting(self, claimant: Claimant, turn: Turn) -> bool:
        for other in list(self._waiting):
            if other is claimant:
                continue
            theirs = other.turn()
            if theirs is None:
                del self._waiting[other]
            elif theirs < turn:
                return True
        return False

    def _may_overdraw(self, claimant: Claimant, turn: Turn) -> bool:
        if self.overdrawn >= self.overdraft:
            return False
        expected = claimant.expected_run_s()
        # Far lighter work than everything holding a slot (short texts beside batches of
        # long ones, say): it would wait a long run out to compute for a moment, and
        # slows those by no more. Per row, so that a model's small batch is not "lighter"
        # than its own big one.
        row_s = claimant.expected_row_s()
        if row_s and all(row_s * _OVERDRAFT_RATIO <= g.row_s for g in self._held):
            return True
        # Short and ahead of everything holding a slot: work no more urgent waits its
        # turn, so a model's own stream of short runs never overdraws behind its earlier
        # ones.
        return expected <= self.short_run_s and all(g.turn > turn for g in self._held)

    def _grant_waiting(self) -> None:
        """Hand freed slots (or a freed overdraft slot) to the best waiting turns."""
        while self._waiting:
            best: tuple[Turn, Claimant] | None = None
            for claimant in list(self._waiting):
                turn = claimant.turn()
                if turn is None:
                    del self._waiting[claimant]
                elif best is None or turn < best[0]:
                    best = (turn, claimant)
            if best is None:
                return
            turn, claimant = best
            need = min(claimant.slots_per_run, self.slots)
            if need <= self.free:
                grant = self._take(need, turn, overdraft=False, wide=self._idle_for(claimant))
            elif self._may_overdraw(claimant, turn):
                grant = self._take(1, turn, overdraft=True)
            else:
                return  # the best waits for enough slots; nobody jumps it
            del self._waiting[claimant]
            claimant.granted(grant)
