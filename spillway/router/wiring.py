"""Building the router from its settings: backends, policy store, pricing, metrics.

Tests and benchmarks pass their own clocks, random source, backends or metrics sink;
everything else comes from ``RouterSettings``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import random
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.canary.records import CanaryStore
from spillway.canary.selection import Affinity, CanaryRouter, backend_config
from spillway.canary.stage import NO_CANARY, CanaryStage, VersionStage
from spillway.capture.buffer import CaptureBuffer
from spillway.capture.watcher import Capture
from spillway.capture.writer import CaptureWriter, s3_client, s3_put
from spillway.policy.accounting import EmfSink, Pricing, event_metric, load_pricing
from spillway.policy.backend import Backend
from spillway.policy.decision import SpillState
from spillway.policy.store import FileSource, PolicySource, PolicyStore, SsmSource
from spillway.protocol.errors import UnavailableError
from spillway.protocol.s3urls import is_s3_url
from spillway.router.app import RouterApp
from spillway.router.async_mode import AsyncFront, inflight_ledger
from spillway.router.backends import HttpBackend, TenantScopes, signed_scopes
from spillway.router.batch_mode import BatchBackend, BatchSubmitter, JobsApiSubmitter, staging_quota
from spillway.router.deadlines import ModelBudgets, backend_lookup
from spillway.router.dispatch import Router
from spillway.router.lambda_backend import LambdaBackend, Payload, cpu_payload, jobs_payload
from spillway.router.openai_compat.catalog import EmbeddingCatalog
from spillway.router.openai_compat.door import OpenAIDoor
from spillway.router.openapi import document_bytes
from spillway.router.sessions import Sessions
from spillway.router.settings import ENV_PREFIX, RouterSettings
from spillway.state.table import StateStore, open_state_store, scope
from spillway.tenancy.directory import (
    LiveConfig,
    LiveConfigCache,
    TenantDirectory,
    apply_log_level,
)
from spillway.tenancy.proof import ScopeProofs

if TYPE_CHECKING:
    from spillway.models.repository import ManagedRepository

log = logging.getLogger("spillway.router")


@dataclass
class Overrides:
    """What a test or benchmark replaces; ``None`` keeps the real thing."""

    clock: Callable[[], float] | None = None
    wall: Callable[[], datetime] | None = None
    rng: random.Random | None = None
    backends: Mapping[str, Backend] | None = None
    submitter: BatchSubmitter | None = None
    sink: EmfSink | None = None
    pricing: Pricing | None = None
    state: StateStore | None = None
    epoch: Callable[[], float] | None = None
    async_store: AsyncStore | None = None
    proofs: ScopeProofs | None = None
    live: LiveConfigCache | None = None
    budgets: ModelBudgets | None = None
    """The models' latency budgets; ``None``: asked from the real backends, and none at
    all with ``backends`` replaced (a test that wants them passes its own)."""
    catalog: EmbeddingCatalog | None = None
    """The OpenAI-compatible door's models; ``None``: read from ``model_repository``."""
    capture_s3: Any = None
    """The S3 client data capture writes with; ``None``: one from boto3's variables, with
    short timeouts (``spillway.capture.writer.s3_client``)."""
    capture_rng: random.Random | None = None
    """The sampling draws of data capture; ``None``: seeded from the OS."""


def make_backends(
    settings: RouterSettings,
    submitter: BatchSubmitter | None,
    state: StateStore | None = None,
    scopes: TenantScopes = scope,
) -> dict[str, Backend]:
    """The backends the settings name (an unset one is left out of every chain); batch
    staging is counted per tenant in ``state`` when there is one. The GPU service and the
    CPU fallback get each caller's tenant scope as ``scopes`` gives it (signed)."""

    def http(name: str, url: str) -> HttpBackend:
        return HttpBackend(
            name,
            url,
            pool_size=settings.pool_size,
            idle_s=settings.pool_idle_s,
            connect_timeout_s=settings.connect_timeout_ms / 1000,
            scopes=scopes,
        )

    def invoked(name: str, function: str, payload: Payload) -> Backend:
        return LambdaBackend(
            name,
            function,
            payload=payload,
            read_timeout_s=settings.lambda_timeout_s,
            connect_timeout_s=settings.connect_timeout_ms / 1000,
        )

    backends: dict[str, Backend] = {}
    if settings.gpu_url:
        backends["gpu"] = http("gpu", settings.gpu_url)
    if settings.cpu_function:
        backends["cpu"] = invoked(
            "cpu", settings.cpu_function, functools.partial(cpu_payload, scopes=scopes)
        )
    elif settings.cpu_url:
        backends["cpu"] = http("cpu", settings.cpu_url)
    if submitter is None and settings.jobs_staging:
        jobs: Backend | None = None
        if settings.jobs_function:
            jobs = invoked("jobs", settings.jobs_function, jobs_payload)
        elif settings.jobs_url:
            jobs = HttpBackend("jobs", settings.jobs_url, pool_size=4)
        if jobs is not None:
            quota = staging_quota(AsyncSettings.from_env(), state) if state is not None else None
            submitter = JobsApiSubmitter(jobs, settings.jobs_staging, quota=quota)
    backends["batch"] = BatchBackend(submitter)
    return backends


def _policy_source(settings: RouterSettings) -> PolicySource | None:
    if settings.policy_parameter:
        return SsmSource(settings.policy_parameter)
    if settings.policy_file is not None:
        return FileSource(settings.policy_file)
    return None


def state_store(settings: RouterSettings) -> StateStore | None:
    """The shared state table the settings name (``None``: none)."""
    return open_state_store(settings.state_table)


def canary_router(
    settings: RouterSettings,
    store: StateStore,
    backends: Mapping[str, Backend],
    *,
    clock: Callable[[], float],
    epoch: Callable[[], float],
    sink: EmfSink,
    rng: random.Random,
) -> CanaryRouter:
    """Canary versions and session affinity over the shared state table."""
    return CanaryRouter(
        CanaryStore(store, epoch),
        Affinity(store, settings.session_ttl_s),
        rng=rng,
        clock=clock,
        ttl_s=settings.canary_ttl_s,
        config_check_s=settings.canary_config_check_s,
        config_source=backend_config(backends, settings.connect_timeout_ms / 1000),
        sink=sink,
    )


def model_budgets(
    settings: RouterSettings, backends: Mapping[str, Backend], clock: Callable[[], float]
) -> ModelBudgets:
    """The models' declared latency budgets, asked from the backends (within the connect
    timeout each) once per ``latency_budget_ttl_s``."""
    lookup = backend_lookup(backends, settings.connect_timeout_ms / 1000)
    return ModelBudgets(lookup, ttl_s=settings.latency_budget_ttl_s, clock=clock)


def async_front(store: AsyncStore | None, state: StateStore | None = None) -> AsyncFront | None:
    """Async mode over the given store, else over the one ``ASYNC_*`` names (if any); its
    per-tenant quota counted in the state table ``state``."""
    if store is None:
        settings = AsyncSettings.from_env()
        if not settings.enabled:
            return None
        store = AsyncStore(settings)
    if state is None:
        log.warning("async mode without ROUTER_STATE_TABLE: no per-tenant async quota")
        return AsyncFront(store)
    return AsyncFront(store, inflight_ledger(store.settings, state))


def create_app(settings: RouterSettings, overrides: Overrides | None = None) -> RouterApp:
    """The router WSGI application for these settings."""
    o = overrides or Overrides()
    clock = o.clock or time.monotonic
    rng = o.rng or random.Random(settings.spill_seed)  # noqa: S311 - spill draws, not secrets
    sink = o.sink or EmfSink(settings.metrics_log)
    store = o.state if o.state is not None else state_store(settings)
    backends: Mapping[str, Backend]
    budgets = o.budgets
    if o.backends is not None:
        backends = o.backends
    else:
        # The scope proof key from SCOPE_PROOF_* (spillway.tenancy.proof): read as the
        # router starts (a Lambda's init), then again in the background once its refresh
        # is due, so a rotation reaches a warm router without a deploy and no request
        # waits for a read (one with a 150 ms budget would spend it there).
        proofs = o.proofs
        if proofs is None:
            proofs = ScopeProofs.from_env(wait=False)
            proofs.prime()
        backends = make_backends(settings, o.submitter, store, signed_scopes(proofs))
        if budgets is None:
            budgets = model_budgets(settings, backends, clock)
    spills = SpillState(rng)
    epoch = o.epoch or time.time
    # Canaries live in the state table: without one, the stand-in stage sends every
    # request as it came.
    versions: VersionStage = NO_CANARY
    if store is not None:
        draws = random.Random(settings.canary_seed)  # noqa: S311 - canary draws, not secrets
        versions = CanaryStage(
            canary_router(settings, store, backends, clock=clock, epoch=epoch, sink=sink, rng=draws)
        )
    policies = PolicyStore(
        _policy_source(settings),
        ttl_s=settings.policy_ttl_s,
        clock=clock,
        on_change=lambda _: spills.reset(),
        on_reject=lambda _: sink.write(event_metric("PolicyRejected")),
    )
    watch = data_capture(settings, policies, sink, o, clock)
    router = Router(
        backends,
        policies,
        config=settings,
        pricing=o.pricing or load_pricing(settings.pricing_file),
        sink=sink,
        spills=spills,
        clock=clock,
        wall=o.wall or (lambda: datetime.now(UTC)),
        versions=versions,
        async_front=async_front(o.async_store, store),
        budgets=budgets,
        watch=watch,
    )
    log.info(
        "router up: backends %s, policy from %s, state table %s, capture to %s",
        sorted(backends),
        policies.loaded.source,
        settings.state_table or "none",
        settings.capture_root or "none",
    )
    sessions = Sessions(
        store,
        ttl_s=settings.session_ttl_s,
        wall=epoch,
        trust_tenant_hints=settings.trust_tenant_hints,
        quota_count=settings.session_quota_count,
        quota_bytes=settings.session_quota_bytes,
    )
    live = o.live or live_config(settings, store)
    live.subscribe(lambda config: live_settings(router, settings, config))
    catalog = o.catalog or embedding_catalog(settings, clock)
    return RouterApp(
        router,
        max_body_bytes=settings.max_body_bytes,
        openapi=document_bytes(),
        identity_tenants=TenantDirectory(live),
        sessions=sessions,
        live=live,
        openai=OpenAIDoor(router, catalog),
    )


CAPTURE_FLUSH_BYTES = (16 * 1024, 64 * 1024 * 1024)
"""A capture batch is written once it holds a quarter of the buffer, within these bounds."""


def data_capture(
    settings: RouterSettings,
    policies: PolicyStore,
    sink: EmfSink,
    o: Overrides,
    clock: Callable[[], float],
) -> Capture | None:
    """Data capture to ``capture_root`` under the policy's ``capture`` section, its
    writer's thread started (``None``: no ``capture_root``, no capture). Its S3 client is
    made on the first write, never at a cold start."""
    root = settings.capture_root
    if root is None:
        return None
    low, high = CAPTURE_FLUSH_BYTES
    buffer = CaptureBuffer(
        max_bytes=settings.capture_buffer_bytes,
        flush_bytes=min(high, max(low, settings.capture_buffer_bytes // 4)),
        flush_s=settings.capture_flush_s,
        clock=clock,
    )
    given = o.capture_s3
    s3: list[Any] = [] if given is None else [given]

    def put(bucket: str, key: str, body: bytes) -> None:
        if not s3:
            s3.append(s3_client())
        s3_put(s3[0])(bucket, key, body)

    wall = o.wall or (lambda: datetime.now(UTC))
    capture = Capture(
        CaptureWriter(buffer, root, put, sink, wall=wall),
        lambda: policies.loaded.policy,  # never a refresh (I/O) on the request's thread
        max_record_bytes=settings.capture_max_record_bytes,
        rng=o.capture_rng,
        clock=clock,
        wall=wall,
    )
    capture.start()
    # A clean stop (`spillway serve router` on SIGINT or SIGTERM) writes what is held; a
    # Lambda environment is never stopped cleanly (docs/capture.md: what can be lost).
    atexit.register(_close_at_exit, weakref.ref(capture))
    return capture


def _close_at_exit(ref: weakref.ref[Capture]) -> None:
    capture = ref()
    if capture is not None:
        capture.close(timeout_s=5.0)


def embedding_catalog(
    settings: RouterSettings, clock: Callable[[], float]
) -> EmbeddingCatalog | None:
    """The models the OpenAI-compatible door offers, from the repository the SSM parameter
    ``model_repository_parameter`` names (read again every ``catalog_ttl_s``), else
    ``model_repository``; ``None`` when neither is set. S3 is read with timeouts that fit
    an interactive request (1 s to connect, 2 s to read, 2 attempts)."""
    parameter, location = settings.model_repository_parameter, settings.model_repository
    if parameter is not None:
        locate = ssm_location(parameter)
    elif location is not None:
        locate = functools.partial(str, location)
    else:
        return None

    def repository(where: str) -> ManagedRepository:
        from spillway.aws.clients import client
        from spillway.models.repository import open_repository

        if not is_s3_url(where):
            return open_repository(where)
        s3 = client("s3", connect_timeout=1, read_timeout=2, max_attempts=2)
        return open_repository(where, client=s3)

    return EmbeddingCatalog(locate, repository, ttl_s=settings.catalog_ttl_s, clock=clock)


def ssm_location(parameter: str) -> Callable[[], str]:
    """The repository location the SSM ``parameter`` holds, fetched at each call (the
    catalogue keeps it ``catalog_ttl_s``); unreadable: 503."""
    source = SsmSource(parameter)

    def locate() -> str:
        from aws_lambda_powertools.utilities.parameters.exceptions import GetParameterError

        try:
            return source.fetch().strip()
        except GetParameterError as exc:
            log.warning("model repository parameter unreadable", extra={"reason": str(exc)[:300]})
            raise UnavailableError(
                "the model repository's location cannot be read now", retry_after_s=1.0
            ) from None

    return locate


def live_config(settings: RouterSettings, store: StateStore | None) -> LiveConfigCache:
    """The live configuration (identity map, log level) in the state table, under the
    settings' own identity map; its log level is set on the ``spillway`` loggers."""
    return LiveConfigCache(
        store,
        ttl_s=settings.config_ttl_s,
        base=settings.identity_tenants,
        listeners=[apply_log_level],
    )


LIVE_SETTINGS = (
    "ROUTER_DEFAULT_DEADLINE_MS",
    "ROUTER_DEADLINE_MARGIN_MS",
    "ROUTER_FALLBACK_RESERVE",
)
"""The router's settings the live configuration may change (``spillway config set``): the
ones each request reads from ``Router.config``; the rest are built into the router's parts
at start (a deploy: their template parameters reach the ``live`` alias)."""


def live_settings(router: Router, settings: RouterSettings, config: LiveConfig) -> None:
    """Put the live configuration's router settings in force over ``settings`` (a value
    that does not validate is logged and the ones in force kept)."""
    overrides = {
        name.removeprefix(ENV_PREFIX).lower(): value
        for name, value in config.overrides(LIVE_SETTINGS).items()
    }
    try:
        router.config = RouterSettings.model_validate({**settings.model_dump(), **overrides})
    except ValidationError as exc:
        log.error("live router settings refused, keeping those in force: %s", exc)
