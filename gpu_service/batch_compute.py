"""Computing a formed batch: the runner contract, its compute threads, one outcome.

A ``Runner`` computes one batch of prepared requests, blocking, one result per request
and in order (the Triton python backend's contract). ``run_batch`` calls it on the
device's compute threads (``gpu_service.compute_budget``: the run holds its slots),
checks that count, and turns any failure into the one error every request of that batch
receives. A request's share of the run comes back as ``Computed``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from spillway import tracing
from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import InferenceError, SpillwayError

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

log = logging.getLogger("spillway.batcher")


class Runner(Protocol):
    """Runs one batch of prepared requests; blocking, called on an executor thread."""

    def run(self, batch: list[Prepared]) -> list[Tensors]:
        """One result per request, in order."""


class WideRunner(Runner, Protocol):
    """A runner with a second session on more threads, for runs that have the device to
    themselves (``spillway.models.engine.OnnxModel``)."""

    def run(self, batch: list[Prepared], wide: bool = False) -> list[Tensors]:
        """One result per request, in order; ``wide``: on the wide session."""


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
    runner: Runner,
    executor: Executor,
    batch: list[Prepared],
    name: str,
    *,
    wide: bool = False,
    links: Sequence[SpanContext | None] = (),
) -> list[Tensors] | SpillwayError:
    """Run one batch of model ``name`` on ``executor``: one result per request, in order,
    or the one error for every request of the batch (an unexpected failure is logged).
    ``wide``: the run holds the whole device (only granted where the runner is wide).

    ``links`` are the batch's requests' spans: the run is one ``spillway.batch`` span,
    a child of the first recorded request's (so that request's trace shows it) and
    linked to every request it carried."""
    run = functools.partial(cast(WideRunner, runner).run, wide=True) if wide else runner.run
    # Under the first request whose trace is recorded (none: no span at all).
    first = tracing.sampled(links)
    span: tracing.Span_ = tracing.NO_SPAN
    if first is not None:
        attributes = {
            "spillway.model": name,
            "spillway.batch.requests": len(batch),
            "spillway.batch.rows": sum(p.rows for p in batch),
            "spillway.batch.wide": wide,
        }
        span = tracing.span("spillway.batch", attributes=attributes, links=links, parent=first)
    with span:
        try:
            results = await asyncio.get_running_loop().run_in_executor(executor, run, batch)
            if len(results) != len(batch):
                raise InferenceError(f"{len(results)} results for {len(batch)} requests")
        except SpillwayError as exc:
            span.fail(exc.code)
            return exc
        except Exception as exc:
            log.exception("a batch of %d requests for %s failed", len(batch), name)
            span.fail(type(exc).__name__)
            return InferenceError(f"inference failed on model {name}: {exc}")
        return results
