"""Router settings: every field from a ``ROUTER_`` environment variable or a CLI flag.

Backend addresses live here and nowhere else: a request can pick a *mode*, never a URL.

This is a pydantic model with a small environment loader rather than a pydantic-settings
class: importing pydantic-settings (asyncio, argparse, dotenv) costs 70-100 ms, a third of
the router's 300 ms cold-start budget, and the router needs only flat fields. Values are
read from ``ROUTER_<FIELD>`` (upper case) and validated exactly as pydantic-settings would
(strings coerced to numbers, booleans and paths).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from spillway.envsettings import json_mapping
from spillway.protocol.errors import InvalidInputError
from spillway.protocol.s3urls import is_s3_url, parse_s3_url
from spillway.protocol.wire import SYNC_BODY_BYTES
from spillway.tenancy.areas import folder

ENV_PREFIX = "ROUTER_"


def _check_url(value: str | None) -> str | None:
    if value is None or value == "":
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL with a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{value!r} may not carry credentials, a query or a fragment")
    return value.rstrip("/")


class RouterSettings(BaseModel):
    """Settings of the router (``ROUTER_<FIELD>`` in the environment)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_url: str | None = "http://127.0.0.1:8000"
    """Base URL of the GPU service (Open Inference Protocol over HTTP); empty: none."""
    cpu_url: str | None = None
    """Base URL of the CPU fallback served over HTTP (``spillway serve cpu``)."""
    cpu_function: str | None = None
    """Name or ARN of the CPU-fallback Lambda, called with ``lambda:Invoke`` (wins over
    ``cpu_url``); the endpoint follows ``AWS_ENDPOINT_URL_LAMBDA`` when that is set."""
    jobs_function: str | None = None
    """Name or ARN of the jobs Lambda, called with ``lambda:Invoke`` to submit batch-mode
    requests (wins over ``jobs_url``); the endpoint follows ``AWS_ENDPOINT_URL_LAMBDA``."""
    jobs_url: str | None = None
    """The jobs API's submit URL (``.../v1/jobs``) for local runs; with neither this nor
    ``jobs_function``, batch-mode requests get 400 ``mode_unavailable``."""
    jobs_staging: str | None = None
    """``s3://bucket/prefix`` where batch-mode requests are staged as job input."""
    policy_file: Path | None = None
    """Policy file (YAML or JSON); neither this nor ``policy_parameter``: the built-in one."""
    policy_parameter: str | None = None
    """SSM parameter holding the policy (wins over ``policy_file``)."""
    policy_ttl_s: float = Field(default=60.0, ge=0)
    """How long a loaded policy is used before its source is checked for a new one."""
    pricing_file: Path | None = None
    """Pricing configuration (YAML or JSON); unset: list prices built into ``cost.py``."""
    max_body_bytes: int = Field(default=SYNC_BODY_BYTES, ge=1024)
    """Largest request body accepted: API Gateway hands the body to the router base64 in a
    6 MB Lambda event, so about 4.4 MiB is all that can arrive (docs/deploy.md)."""
    default_deadline_ms: float = Field(default=5000.0, gt=0)
    """Deadline of a request that sets no latency budget and whose model declares none
    (``spillway.latency_budget_ms`` in its ``config.json``): interactive calls fail fast."""
    latency_budget_ttl_s: float = Field(default=60.0, ge=0, le=3600)
    """How long a model's declared latency budget (its ``config.json`` as a backend serves
    it: the GPU service, else the CPU fallback) is used before it is asked again; a
    request that states its own budget asks nothing."""
    deadline_margin_ms: float = Field(default=150.0, ge=0)
    """Kept back from the Lambda's remaining time to answer before the function times out."""
    fallback_reserve: float = Field(default=0.3, ge=0, lt=1)
    """Share of the remaining deadline an attempt leaves for the backends after it."""
    connect_timeout_ms: float = Field(default=500.0, gt=0)
    """Longest wait for a TCP connection to a backend."""
    pool_size: int = Field(default=32, ge=1, le=1024)
    """Idle keep-alive connections kept per backend."""
    pool_idle_s: float = Field(default=30.0, gt=0)
    """An idle connection older than this is closed rather than reused."""
    breaker_failures: int = Field(default=5, ge=1)
    """Consecutive failures that open a backend's circuit."""
    breaker_reset_s: float = Field(default=5.0, gt=0)
    """Time an open circuit waits before a trial request (doubled on each re-open)."""
    breaker_max_reset_s: float = Field(default=120.0, gt=0)
    """Upper bound of the growing wait of a re-opened circuit."""
    breaker_probe_interval_s: float = Field(default=1.0, gt=0, le=60)
    """A circuit opened by refused connections asks the backend's readiness
    (``GET /v2/health/ready``) at most this often instead of waiting out its reset time;
    a ready answer lets the next request through as its trial."""
    breaker_probe_timeout_s: float = Field(default=0.25, gt=0, le=5)
    """Longest wait for one readiness probe's answer."""
    retry_budget: float = Field(default=0.1, ge=0, le=1)
    """Retries (connect errors only) allowed per request, on average."""
    load_halflife_s: float = Field(default=10.0, gt=0)
    """Half-life of the moving average of a backend's reported busy fraction."""
    load_stale_s: float = Field(default=30.0, gt=0)
    """A load reading older than this says nothing (the backend counts as cool)."""
    spill_seed: int | None = None
    """Seed of the spill draws (tests); unset: seeded from the OS."""
    lambda_timeout_s: float = Field(default=30.0, gt=0)
    """Longest read timeout of a ``lambda:Invoke`` call; each call waits no longer than
    what is left of its request's deadline."""
    metrics_log: Path | None = None
    """Append EMF metric lines here instead of stdout (local runs, ``spillway cost report``)."""
    trust_tenant_hints: bool = False
    """Let a request name its own tenant (header or parameter) when API Gateway vouched for
    none. Off by default: any caller could claim a premium tenant. For local runs only."""
    identity_tenants: dict[str, str] = Field(default_factory=dict)
    """Tenants of authenticated identities, as JSON: ``{"<API key id or IAM principal
    ARN>": "<tenant>"}``; an unmapped identity is its own tenant (list it in the policy's
    ``tenants`` to give it a tier). A base under the live configuration's map
    (``spillway tenants``, in ``state_table``), which deployments use instead."""
    config_ttl_s: float = Field(default=30.0, ge=0, le=3600)
    """How long the live configuration (``spillway tenants``, ``spillway config``: the
    identity map and the log level, one item of ``state_table``) is used before it is read
    again: a change reaches every router within this time, without a deploy."""
    state_table: str | None = None
    """DynamoDB table shared by every router instance: canary settings, session affinity
    and session state (TTL attribute ``expires_at``); unset: no canaries, no sessions."""
    canary_ttl_s: float = Field(default=5.0, ge=0, le=300)
    """How long a model's canary setting is cached before the table is read again: a
    change or a rollback another router wrote is followed within this time."""
    canary_config_check_s: float = Field(default=60.0, gt=0)
    """How often a model's ``config.json`` is asked (from a backend) for a
    ``spillway.canary`` to start."""
    session_ttl_s: float = Field(default=900.0, ge=1, le=86400)
    """Life of session state and of a session's version affinity, renewed on each use."""
    session_quota_count: int = Field(default=256, ge=1, le=2000)
    """Sessions one tenant may hold at once; past it a new session is 429
    ``quota_exceeded`` until one is deleted or expires. Each tenant's sessions are listed
    in one ledger item that every new or resized session rewrites, so the bound (2,000)
    keeps that item far below DynamoDB's 400 KB and its write cost small."""
    session_quota_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024, le=1024**3)
    """Bytes of session JSON one tenant may hold at once (as stored, compact); past it a
    new or larger session is 429 ``quota_exceeded``. 4 MiB: 64 sessions at the 64 KiB cap."""
    canary_seed: int | None = None
    """Seed of the canary draws (tests); unset: seeded from the OS."""
    model_repository: str | None = None
    """The model repository (a folder or ``s3://bucket/prefix``), read by the
    OpenAI-compatible door alone, and only its models' ``config.json`` and ``SHA256SUMS``:
    which ``text_embedding`` models there are and their signatures. Neither this nor
    ``model_repository_parameter``: the door's paths answer 400 ``not_configured`` (the
    router reads the repository for nothing else)."""
    model_repository_parameter: str | None = None
    """SSM parameter holding ``model_repository`` (wins over it; the templates set it):
    read at the door's first request and again every ``catalog_ttl_s``, so a repository
    moved by a deploy reaches a warm router without a new function version."""
    catalog_ttl_s: float = Field(default=60.0, ge=0, le=3600)
    """How long the OpenAI-compatible door uses the repository's location, its list of
    models and a model's signature before reading them again: a model published or
    changed reaches every router within this time."""
    capture_root: str | None = None
    """``s3://bucket/prefix`` where data capture writes each tenant's sampled requests and
    answers (``<root>/<tenant scope>/<model>/YYYY/MM/DD/HH/…jsonl.gz``); which requests,
    at what rate, is the policy's ``capture`` section. Unset: no capture."""
    capture_buffer_bytes: int = Field(default=8 * 1024 * 1024, ge=64 * 1024, le=1024**3)
    """Memory the capture buffer may hold (records waiting and being written); a record
    that does not fit is dropped and counted (``CaptureDropped``), never waited for."""
    capture_flush_s: float = Field(default=60.0, gt=0, le=3600)
    """Longest a captured record waits in the buffer before its batch is written; a batch
    is written sooner once it holds a quarter of ``capture_buffer_bytes``."""
    capture_max_record_bytes: int = Field(default=256 * 1024, ge=1024, le=64 * 1024 * 1024)
    """Bodies one record keeps at most (request and answer together, before encoding): a
    body past it is left out and the record marked ``truncated`` (not replayable)."""
    tracing: bool = False
    """Create the X-Ray tracer (imported only when true, so cold starts do not pay for it)."""
    host: str = "127.0.0.1"
    """Address ``spillway serve router`` listens on."""
    port: int = Field(default=8080, ge=0, le=65535)
    """Port ``spillway serve router`` listens on."""
    log_level: str = "INFO"
    """Log level of the router."""

    _urls = field_validator("gpu_url", "cpu_url", "jobs_url")(_check_url)

    @field_validator("jobs_staging", "model_repository", "capture_root")
    @classmethod
    def _s3_location(cls, value: str | None, info: ValidationInfo) -> str | None:
        if not value:
            return None
        if info.field_name == "model_repository" and not is_s3_url(value):
            return value  # a folder, checked when the door first reads it
        try:
            parse_s3_url(value)
            if info.field_name == "capture_root":
                folder(value)  # no empty, '.' or '..' segment: the tenants' areas lie below
        except InvalidInputError as exc:  # pydantic reports only ValueError as invalid
            raise ValueError(exc.message) from None
        return value

    @field_validator("identity_tenants", mode="before")
    @classmethod
    def _json_map(cls, value: Any) -> Any:
        return json_mapping(value)

    @field_validator("cpu_function", "jobs_function", "model_repository_parameter")
    @classmethod
    def _function_name(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            return None
        return value

    @model_validator(mode="after")
    def _reset_bounds(self) -> RouterSettings:
        if self.breaker_max_reset_s < self.breaker_reset_s:
            raise ValueError("breaker_max_reset_s must be at least breaker_reset_s")
        if self.capture_max_record_bytes > self.capture_buffer_bytes:
            raise ValueError("capture_max_record_bytes must be at most capture_buffer_bytes")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **flags: Any) -> RouterSettings:
        """Settings from ``ROUTER_*`` variables, overridden by the flags that are not None."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {
            name: env[key]
            for name in cls.model_fields
            if (key := f"{ENV_PREFIX}{name.upper()}") in env
        }
        values.update({name: value for name, value in flags.items() if value is not None})
        return cls.model_validate(values)
