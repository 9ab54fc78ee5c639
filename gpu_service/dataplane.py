"""What each endpoint does, apart from HTTP: the service's request handling.

The HTTP module translates requests and responses; this module decodes, validates,
queues and encodes, and counts what happened.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeVar

from gpu_service.registry import MISS_LIST_S, ModelRegistry
from gpu_service.served import InferCall, InferResult, Served
from gpu_service.settings import GpuSettings
from spillway import inference, tracing
from spillway.protocol.errors import ControlDisabledError, UnauthorizedError, UnavailableError
from spillway.protocol.v2 import server_metadata
from spillway.protocol.wire import read_tenant_scope
from spillway.tenancy.proof import ScopeProofs

log = logging.getLogger("spillway.server")
T = TypeVar("T")
EXTENSIONS = ["binary_tensor_data", "statistics", "model_configuration", "schedule_policy"]
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


class BodyBudget:
    """Bytes of request bodies held at once, charged as they are received (an announced
    size reserves nothing). A request whose declared size does not fit what is held now
    is refused with 503 and ``Retry-After`` before its body is read; a piece of body that
    would pass the limit ends its request with the same 503. Event loop only."""

    READY_ROOM = 64 * 1024
    """Readiness turns false while less than this (or a quarter of the limit, if less) is
    free: a small request would not fit."""

    def __init__(self, limit: int, retry_after_s: float) -> None:
        self.limit = limit
        self.in_use = 0
        self._retry_after_s = retry_after_s

    def admit(self, size: int) -> None:
        """Refuse a request announcing ``size`` bytes that cannot fit beside what is held
        now; reserves nothing."""
        if self.in_use + size > self.limit:
            raise self._full()

    def charge(self, size: int) -> None:
        """Hold ``size`` more bytes just received; the caller releases them when done
        (a pair of calls, not a context manager: this is on every request's path)."""
        if self.in_use + size > self.limit:
            raise self._full()
        self.in_use += size

    def release(self, size: int) -> None:
        self.in_use -= size

    @property
    def saturated(self) -> bool:
        """Too little is free for another small request."""
        return self.limit - self.in_use < min(self.READY_ROOM, self.limit // 4)

    def _full(self) -> UnavailableError:
        return UnavailableError(
            "too many request bytes in flight; retry shortly", retry_after_s=self._retry_after_s
        )


class DataPlane:
    """The Open Inference Protocol operations over a model registry: each per-model one
    finds the name in the registry once and asks what serves it (a model or a pipeline,
    ``gpu_service.served.Served``)."""

    def __init__(
        self, registry: ModelRegistry, settings: GpuSettings, scopes: ScopeProofs | None = None
    ) -> None:
        self.registry = registry
        self.settings = settings
        # Verifies the router's tenant scopes on the event loop: keys read in the background.
        self.scopes = scopes or ScopeProofs.from_env(wait=False)
        self.draining = False
        self.bodies = BodyBudget(settings.max_body_bytes_in_flight, settings.retry_after_s)
        self._parse_pool = ThreadPoolExecutor(settings.parse_threads, thread_name_prefix="parse")
        # Started on the first big JSON body; spawned, never forked (CUDA is not fork-safe).
        self._json_pool = ProcessPoolExecutor(
            settings.parse_processes, mp_context=multiprocessing.get_context("spawn")
        )

    def close(self) -> None:
        """Stop the parse threads and processes (after the registry has drained)."""
        self._parse_pool.shutdown(wait=False, cancel_futures=True)
        self._json_pool.shutdown(wait=False, cancel_futures=True)

    def start_draining(self, reason: str) -> None:
        """Turn readiness false and refuse new infer requests (logged once)."""
        if not self.draining:
            log.info(
                "%s: readiness false, draining for up to %.0f s",
                reason,
                self.settings.drain_timeout_s,
            )
        self.draining = True

    def check_infer(self, name: str) -> bool:
        """Refuse an infer request before its body is read: draining, or an invalid
        model name. Whether the registry knows the model now: if not, ``lookup`` answers
        once the repository has been listed again."""
        self._check_draining()
        return self.registry.known(name)

    async def lookup(
        self, name: str, timeout_s: float | None = None, *, listed_within_s: float = 0.0
    ) -> Served:
        """What serves ``name`` (``ModelRegistry.lookup``): a model published since the
        registry last listed the repository is found, a name it does not hold is a 404
        within ``timeout_s`` (and ``registry.MISS_WAIT_S``; at once when a listing began
        less than ``listed_within_s`` ago)."""
        return await self.registry.lookup(name, timeout_s, listed_within_s=listed_within_s)

    async def found(self, name: str) -> None:
        """Wait until ``name`` is known: metadata, ready, config and stats find a model
        published since the last listing as an infer request does, unless a listing
        began less than ``MISS_LIST_S`` ago (then a miss is a 404 at once)."""
        if not self.registry.known(name):
            await self.lookup(name, listed_within_s=MISS_LIST_S)

    def _check_draining(self) -> None:
        if self.draining:
            raise UnavailableError(
                "the service is shutting down", retry_after_s=self.settings.retry_after_s
            )

    def server_metadata(self) -> dict[str, Any]:
        extensions = EXTENSIONS + ["model_repository"] * self.control_enabled
        return server_metadata("spillway-gpu", extensions)

    @property
    def control_enabled(self) -> bool:
        return self.settings.model_control_mode == "explicit"

    def ready(self) -> bool:
        """Whether the service can admit work: not draining, its start-up models loaded,
        and room in the body budget (a load balancer then sends work elsewhere)."""
        return not self.draining and self.registry.ready and not self.bodies.saturated

    def model_ready(self, name: str, version: str | None) -> bool:
        return self.registry.find(name).ready(version) and not self.draining

    def model_metadata(self, name: str, version: str | None) -> dict[str, Any]:
        return self.registry.find(name).metadata(version)

    def model_config(self, name: str, version: str | None) -> dict[str, Any]:
        return self.registry.find(name).config(version)

    def model_stats(self, name: str | None, version: str | None) -> dict[str, Any]:
        if name is None:
            return {"model_stats": self.registry.all_stats()}
        return {"model_stats": self.registry.find(name).stats(version)}

    async def repository_index(self) -> list[dict[str, str]]:
        return await self.registry.index()

    async def load(self, name: str) -> None:
        """Load (or re-read) a model: new versions are swapped in without failing requests."""
        self._check_control()
        failures = await self.registry.sync(name)
        if failures:
            raise failures[0]

    async def unload(self, name: str) -> None:
        self._check_control()
        await self.registry.unload(name)

    def authorize(self, authorization: str | None) -> None:
        """Admit a repository control request by its ``Authorization`` value: it must be
        ``Bearer <GPU_ADMIN_TOKEN>``; without a token set, only a service listening on
        loopback takes control requests."""
        token = self.settings.admin_token
        if token is None:
            if self.settings.host in _LOOPBACK:
                return
            raise UnauthorizedError(
                "repository control needs GPU_ADMIN_TOKEN when the service listens beyond loopback"
            )
        given = (authorization or "").encode()
        if not hmac.compare_digest(given, f"Bearer {token.get_secret_value()}".encode()):
            raise UnauthorizedError("repository control needs the admin token")

    def _check_control(self) -> None:
        if not self.control_enabled:
            raise ControlDisabledError(
                f"model control is disabled (--model-control-mode "
                f"{self.settings.model_control_mode}); use explicit"
            )

    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        *,
        tenant_scope: str | None = None,
        stored_scope: str | None = None,
    ) -> InferResult:
        """Run one request through the core request path on what serves ``name``: a
        model's version, executing on its batcher, or a pipeline, whose steps do.

        Big bodies are decoded, prepared and encoded on the parse threads; text requests
        are tokenised there together with the others that arrived meanwhile. The name is
        looked up once the body is decoded (the transport checked it before reading it; a
        model the registry did not know then is waited for: ``lookup``).
        ``tenant_scope`` is the ``x-spillway-tenant-scope`` value a door received: an
        pipeline's step cache entries are the tenant's whose scope it proves (signed by
        the router), and a request it proves nothing for uses no tenant's entries.
        ``stored_scope`` is the scope of an async record the router stored (trusted as
        stored; never a client's header)."""
        self._check_draining()
        scope = self._scope(tenant_scope, stored_scope)
        arrived = time.perf_counter()
        big = len(body) > self.settings.inline_parse_bytes
        with _traced(name, version, len(body)) as span:
            if big:
                decoded = await self._decode(body, header_length)
            else:
                decoded = inference.decode(body, header_length, self.settings.max_body_bytes)
            call = InferCall(decoded, arrived, self._offload, big, scope)
            served = await self.lookup(name, decoded.parameters.timeout_s)
            return _answered(span, await served.infer(version, call))

    async def infer_decoded(
        self,
        name: str,
        version: str | None,
        decoded: inference.Decoded,
        *,
        arrived: float,
        size: int,
        tenant_scope: str | None = None,
    ) -> InferResult:
        """``infer`` for a request another transport has decoded (gRPC's messages):
        ``arrived`` is its ``time.perf_counter()`` arrival and ``size`` its message's
        bytes, which decide as a body's length does whether the rest of its path runs on
        the parse threads. ``tenant_scope`` is proven as ``infer`` proves it."""
        self._check_draining()
        scope = self.scopes.verify(tenant_scope)
        big = size > self.settings.inline_parse_bytes
        with _traced(name, version, size) as span:
            call = InferCall(decoded, arrived, self._offload, big, scope)
            served = await self.lookup(name, decoded.parameters.timeout_s)
            return _answered(span, await served.infer(version, call))

    def _scope(self, claimed: str | None, stored: str | None) -> str | None:
        """The tenant scope a request's step cache entries are kept under (``None``:
        none proven, no tenant's entries)."""
        if stored is not None:
            return read_tenant_scope(stored)
        return self.scopes.verify(claimed)

    async def _decode(self, body: bytes, header_length: int | None) -> inference.Decoded:
        """A big body: binary on a thread (numpy reads the tensor bytes without the
        GIL-bound work); a big JSON header in a parse process."""
        limit, inline = self.settings.max_body_bytes, self.settings.inline_parse_bytes
        loop = asyncio.get_running_loop()
        if (header_length if header_length is not None else len(body)) > inline:
            pool: Executor = self._json_pool
        else:
            pool = self._parse_pool
        return await loop.run_in_executor(pool, inference.decode, body, header_length, limit)

    async def _offload(self, function: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._parse_pool, function, *args)


def _traced(name: str, version: str | None, size: int) -> tracing.Span_:
    """The request's ``spillway.gpu.infer`` span (a child of the trace its caller sent):
    its queue, batch and pipeline steps' spans are within it."""
    if not tracing.enabled():
        return tracing.NO_SPAN
    attributes = {"spillway.model": name, "spillway.version": version, "spillway.bytes": size}
    return tracing.span("spillway.gpu.infer", kind="server", attributes=attributes)


def _answered(span: tracing.Span_, result: InferResult) -> InferResult:
    """The result, its served version and the queue it met written on the span."""
    if span is tracing.NO_SPAN:
        return result
    span.set("spillway.served_version", result.version)
    span.set("spillway.queue_depth", result.queue_depth)
    span.set("spillway.cold_start_s", result.cold_start_s)
    return result
