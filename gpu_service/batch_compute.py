"""Computing a formed batch: the runner contract, its compute threads, one outcome.

A ``Runner`` computes one batch of prepared requests, blocking, one result per request
and in order (the Triton python backend's contract). ``run_batch`` calls it on the
bucket's executor, checks that count, and turns any failure into the one error every
request of that batch receives. Each length bucket computes on its own thread pool
(``compute_pool``) at the bucket's OS niceness, so long inputs yield the CPU to short
ones. A request's share of the run comes back as ``Computed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import InferenceError, SpillwayError

log = logging.getLogger("spillway.batcher")


class Runner(Protocol):
    """Runs one batch of prepared requests; blocking, called on an executor thread."""

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        """One result per request, in order."""


@dataclass(frozen=True)
class Computed:
    """A request's own rows and its time in the batcher: ``queue_s`` waiting for its
    batch, ``infer_s`` the whole run of that batch (Triton counts the run for each of a
    batch's requests). The caller records them with the rest of the request's statistics
    (``ModelStats.record_success``) when it is answered, so they move together."""

    tensors: Tensors
    queue_s: float
    infer_s: float


async def run_batch(
    runner: Runner, executor: Executor, batch: list[Prepared], name: str
) -> list[Tensors] | SpillwayError:
    """Run one batch of model ``name`` on ``executor``: one result per request, in order,
    or the one error for every request of the batch (an unexpected failure is logged)."""
    try:
        results = await asyncio.get_running_loop().run_in_executor(executor, runner.run, batch)
        if len(results) != len(batch):
            raise InferenceError(f"{len(results)} results for {len(batch)} requests")
    except SpillwayError as exc:
        return exc
    except Exception as exc:
        log.exception("a batch of %d requests for %s failed", len(batch), name)
        return InferenceError(f"inference failed on model {name}: {exc}")
    return results


def compute_pool(threads: int, niceness: int, name: str) -> ThreadPoolExecutor:
    """Compute threads of one length bucket, at the bucket's OS scheduling niceness."""
    return ThreadPoolExecutor(
        threads, thread_name_prefix=f"ort-{name}", initializer=_renice, initargs=(niceness,)
    )


def _renice(niceness: int) -> None:
    # Linux applies setpriority to a single thread when given its thread id.
    if niceness and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
