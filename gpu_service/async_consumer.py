"""The GPU service's consumer of asynchronous requests (``spillway.async_inference``).

Pull-based backpressure: the consumer asks the queue for work only while it has room —
fewer than ``concurrency`` of its requests in flight and no batcher holding a full batch
of queued work — so a busy service simply stops polling; async work is never refused
with 429, it waits in the queue (and past ``ASYNC_DRAIN_AGE_S`` the CPU fallback drains
it). Fair across tenants: the consumer holds up to ``ASYNC_LOOKAHEAD`` deliveries beyond
those it runs and starts them in ``fair_order`` (the tenant with the fewest requests
running first), so one tenant's burst does not run ahead of another's single request;
a delivery held for half its lease is let go unclaimed (the queue shows it again). Each
request runs through ``DataPlane.infer``, the path and batchers synchronous requests use,
at the lowest priority level the model has, inside the trace the router accepted it in
(``spillway.async_inference.traced``). AWS calls (blocking boto3) run on a thread of
their own so the event loop never waits on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pydantic_core

from gpu_service.dataplane import DataPlane
from spillway import tracing
from spillway.async_inference.queue import Message, fair_order
from spillway.async_inference.records import owner_scope
from spillway.async_inference.replies import failure_reply
from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore, Job
from spillway.async_inference.traced import running, settled
from spillway.protocol.framing import read_json_header
from spillway.protocol.replies import Reply, infer_reply

log = logging.getLogger("spillway.gpu.async")


def as_background(body: bytes, header_length: int | None, level: int) -> tuple[bytes, int | None]:
    """The request with ``parameters.priority`` set to ``level`` (the model's lowest), its
    binary tensor bytes carried over as they are."""
    header = read_json_header(body, header_length)
    parameters = dict(header.get("parameters") or {})
    parameters["priority"] = level
    head = pydantic_core.to_json({**header, "parameters": parameters}, inf_nan_mode="constants")
    if header_length is None:
        return head, None
    return head + body[header_length:], len(head)


class AsyncConsumer:
    """Polls the async queue while the service has room and runs what it receives."""

    def __init__(
        self,
        plane: DataPlane,
        store: AsyncStore,
        *,
        concurrency: int,
        poll_wait_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plane = plane
        self.store = store
        self.concurrency = concurrency
        self.poll_wait_s = poll_wait_s
        self.lookahead = store.settings.lookahead
        self.clock = clock
        self.owner = f"gpu:{socket.gethostname()}:{os.getpid()}"
        self._inflight: set[asyncio.Task[None]] = set()
        # Deliveries received but not started (with when), and what runs, by tenant scope.
        self._held: list[tuple[float, Message]] = []
        self._running: Counter[str] = Counter()
        self._room = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        # One thread for the poll and a few for the record/S3 calls of running requests.
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="async-io")
        self.completed = 0

    def start(self) -> None:
        """Begin polling (on the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, timeout_s: float) -> None:
        """Stop polling and wait (up to ``timeout_s``) for the requests in flight; any left
        are redelivered by the queue once their lease runs out."""
        self._stopping = True
        self._room.set()
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=timeout_s)
            self._task.cancel()
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=timeout_s)
        self._io.shutdown(wait=False, cancel_futures=True)

    def room(self) -> int:
        """How many more requests to take now: none while a batcher holds a full batch of
        queued work (synchronous requests come first) or ``concurrency`` are in flight."""
        for served in self.plane.registry.all_versions():
            batcher = served.batcher
            if batcher.queue_depth >= batcher.policy.max_batch_size:
                return 0
        return max(0, self.concurrency - len(self._inflight))

    async def _call(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, function, *args)

    async def _run(self) -> None:
        while not self._stopping:
            room = self.room()
            if room == 0:
                self._room.clear()
                # Woken when one of ours finishes; a batcher's queue drains on its own.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), timeout=0.05)
                continue
            wanted = min(10, room + self.lookahead - len(self._held))
            if wanted > 0:
                # Only a short look when deliveries are held already: they start now.
                wait_s = 0.0 if self._held else self.poll_wait_s
                try:
                    messages = await self._call(self.store.receive, wanted, wait_s)
                except Exception:
                    log.exception("async queue poll failed; retrying")
                    await asyncio.sleep(1.0)
                    continue
                now = self.clock()
                self._held.extend((now, message) for message in messages)
            for message in self._take(room):
                self._running[message.scope] += 1
                task = asyncio.get_running_loop().create_task(self._handle(message))
                self._inflight.add(task)
                task.add_done_callback(self._done)

    def _take(self, room: int) -> list[Message]:
        """Up to ``room`` held deliveries to start, in fair order; those held for half
        their lease are let go (the queue shows them again once it ends)."""
        fresh = self.clock() - self.store.settings.lease_s / 2
        held = [(at, m) for at, m in self._held if at >= fresh]
        order = fair_order((m for _, m in held), self._running)
        started = order[:room]
        when = {id(m): at for at, m in held}
        self._held = [(when[id(m)], m) for m in order[room:]]
        return started

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._room.set()

    async def _handle(self, message: Message) -> None:
        try:
            await self._process(message)
        finally:
            self._running[message.scope] -= 1
            if self._running[message.scope] <= 0:
                del self._running[message.scope]

    async def _process(self, message: Message) -> None:
        try:
            job = await self._call(self.store.claim, message, self.owner)
            if job is None:
                return
            # The request's trace (the router's span): the batches it joins are its own.
            with running(job.record, "gpu") as span:
                reply = await self._run_job(job)
                state = await self._call(self.store.settle, job, reply)
                settled(span, state, reply)
            if state is not None:
                self.completed += 1
            log.info(
                "async request %s: %s",
                job.record.id,
                state or "retry",
                extra={"status": reply.status, "attempt": message.receive_count},
            )
        except Exception:  # the delivery comes back after its lease: nothing is lost
            log.exception("async request %s could not be settled", message.id)

    async def _run_job(self, job: Job) -> Reply:
        record = job.record
        try:
            body, length = await self._call(self.store.read_input, job)
            await self.plane.lookup(record.model)  # one published since: found, as infer finds it
            config = self.plane.registry.entry(record.model).config
            batching = config.dynamic_batching if config is not None else None
            levels = batching.priority_levels if batching is not None else 1
            if levels > 1:
                body, length = as_background(body, length, levels)
            # The scope the router stored with the record: trusted as stored.
            result = await self.plane.infer(
                record.model, record.version, body, length, stored_scope=owner_scope(record)
            )
        except Exception as error:  # noqa: BLE001 - every outcome is recorded
            return failure_reply(error)
        return infer_reply(result.body, result.header_length, result.version)


def start_consumer(plane: DataPlane) -> AsyncConsumer | None:
    """The consumer, polling, when ``ASYNC_*`` names a queue and ``GPU_ASYNC_CONCURRENCY``
    is above 0; else None."""
    settings = AsyncSettings.from_env()
    if not settings.enabled or plane.settings.async_concurrency == 0:
        return None
    tracing.configure("spillway-gpu-async")  # nothing changes where the service configured it
    consumer = AsyncConsumer(
        plane, AsyncStore(settings), concurrency=plane.settings.async_concurrency
    )
    consumer.start()
    log.info("consuming async requests from %s", settings.queue_url)
    return consumer
