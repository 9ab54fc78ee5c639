"""Preparing requests together: one tokenising call for the text requests that arrive at
about the same time, off the event loop.

Tokenising one short text costs little, but doing it on the event loop stalls every other
connection, and a thread hop per request costs more than the tokenising. The queue takes
what arrived while the previous call ran (natural batching: no timer, no waiting when
alone) and hands it to ``inference.admit_many`` on a worker thread, where the tokenizers
library encodes all the texts in parallel without the GIL. Each request still gets its
own outcome: a bad text fails only its own request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from spillway import inference
from spillway.models.engine import OnnxModel
from spillway.protocol.errors import SpillwayError, UnavailableError

_Waiting = tuple[inference.Decoded, asyncio.Future[inference.Admitted]]


@dataclass(eq=False)
class PrepareQueue:
    """Admits one model version's requests in batches, one worker call at a time.

    ``limit`` caps the requests of one call, so a burst is split into calls whose first
    results come back early."""

    model: OnnxModel
    limit: int = 64
    _waiting: list[_Waiting] = field(default_factory=list)
    _busy: bool = False
    _call: asyncio.Future[list[inference.Admitted | SpillwayError]] | None = None

    async def admit(
        self, decoded: inference.Decoded, offload: inference.Offload
    ) -> inference.Admitted:
        """Validate and prepare one request together with whoever else is waiting;
        ``offload`` runs the blocking call on a worker thread."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[inference.Admitted] = loop.create_future()
        self._waiting.append((decoded, future))
        if not self._busy:
            self._busy = True
            # On the next loop turn, so requests read in this one join the same call.
            loop.call_soon(self._start, offload)
        return await future

    def _start(self, offload: inference.Offload) -> None:
        batch = [(d, f) for d, f in self._waiting[: self.limit] if not f.done()]
        del self._waiting[: self.limit]
        if not batch:
            self._next(offload)
            return
        self._call = call = asyncio.ensure_future(
            offload(inference.admit_many, self.model, [d for d, _ in batch])
        )
        call.add_done_callback(lambda done: self._deliver(batch, done, offload))

    def _deliver(
        self, batch: list[_Waiting], call: asyncio.Future[Any], offload: inference.Offload
    ) -> None:
        # A failure of the call itself (not one request's error) reaches every request
        # of the call, and the transport's last-resort handler logs it.
        if call.cancelled():  # the worker pool shut down under it
            error: BaseException | None = UnavailableError("the service is shutting down")
        else:
            error = call.exception()
        outcomes = [error] * len(batch) if error is not None else call.result()
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():  # the client went away meanwhile
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        self._next(offload)

    def _next(self, offload: inference.Offload) -> None:
        if self._waiting:
            asyncio.get_running_loop().call_soon(self._start, offload)
        else:
            self._busy = False
