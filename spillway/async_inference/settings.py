"""Where asynchronous requests live: ``AsyncSettings`` (``ASYNC_<FIELD>``), read alike by
the router, the GPU service and the CPU fallback."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from spillway.envsettings import json_mapping, prefixed_values

ENV_PREFIX = "ASYNC_"
MAX_INPUT_BYTES = 1024**3
"""The largest ``input_location`` object ``max_input_bytes`` may allow (1 GiB)."""


class AsyncSettings(BaseModel):
    """Where asynchronous requests live (``ASYNC_<FIELD>`` in the environment); the
    router, the GPU service and the CPU fallback read the same variables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    table: str | None = None
    """DynamoDB table of request records (key ``id``, TTL attribute ``expires_at``, sparse
    index ``pending`` on ``pending``/``created_at``); unset: async mode is off."""
    queue_url: str | None = None
    """SQS queue of request ids (its redrive policy sends a message to the dead-letter
    queue after ``max_attempts`` deliveries)."""
    location: str | None = None
    """``s3://bucket/prefix`` where request bodies and results are kept."""
    input_prefixes: list[str] = Field(default_factory=list)
    """More roots of tenant areas (``s3://bucket/prefix``) besides ``<location>/inputs``:
    a request's ``input_location`` / ``output_location`` must lie in
    ``<root>/<tenant scope>/`` of one of them (the consumers read and write there with
    their own roles). A root may not overlap ``<location>`` outside its ``inputs/``."""
    ttl_s: int = Field(default=86_400, ge=60, le=30 * 86_400)
    """How long a request's record and result are kept after it is accepted."""
    max_attempts: int = Field(default=3, ge=1, le=20)
    """Deliveries before a request that keeps failing is given up (equal to the queue's
    ``maxReceiveCount``)."""
    lease_s: int = Field(default=60, ge=1, le=43_200)
    """How long a claimed request is held by one consumer (the queue's visibility
    timeout); after it, a redelivery may take it over."""
    topic_arn: str | None = None
    """SNS topic told of every finished request (``{"id", "state", "status"}``); unset:
    none."""
    drain_age_s: float = Field(default=120.0, ge=0)
    """Age of the oldest pending request past which the CPU fallback drains the queue."""
    max_input_bytes: int = Field(default=MAX_INPUT_BYTES, ge=1, le=MAX_INPUT_BYTES)
    """Largest object an ``input_location`` may name (checked with a HEAD when the
    request is submitted: 413 beyond it)."""
    tenant_max_inflight: int = Field(default=32, ge=1, le=2000)
    """Async requests one tenant may have queued or running at once (counted in the
    router's state table); past it a submission is 429 ``quota_exceeded`` with
    Retry-After. It bounds how far one tenant's burst can get ahead of another's request."""
    tenant_max_staged_bytes: int = Field(default=256 * 1024**2, ge=1024, le=64 * 1024**3)
    """Request bodies the router may hold staged in S3 for one tenant: those of its async
    requests in flight, and (a budget of its own) its batch-mode requests staged within
    ``staging_window_s``; past it 429 ``quota_exceeded``."""
    quota_recheck_s: float = Field(default=5.0, ge=0.1, le=3600)
    """How long a counted request is taken as still in flight before the quota, when
    full, reads its record again (a settled request frees its place within this)."""
    staging_window_s: float = Field(default=3600.0, ge=1, le=30 * 86_400)
    """The window of the batch-mode staging budget: bytes a tenant staged longer ago
    than this no longer count."""
    tenant_max_batch_staged: int = Field(default=1000, ge=1, le=2000)
    """Batch-mode requests one tenant may stage within ``staging_window_s``."""
    lookahead: int = Field(default=10, ge=0, le=100)
    """Deliveries a consumer holds beyond those it runs, to pick the next request from
    the tenant with the fewest running (0: first come, first served)."""
    state_machines: dict[str, str] = Field(default_factory=dict)
    """Pipelines that run as a Step Functions execution (JSON ``{"pipeline": "<state
    machine ARN>"}``): an async request for one of them is started as an execution of its
    state machine instead of being queued, and the execution's end settles its record.
    The templates name every pipeline with a definition in ``infra/statemachines``."""

    @field_validator("state_machines", mode="before")
    @classmethod
    def _mapping(cls, value: Any) -> Any:
        return json_mapping(value)

    @field_validator("input_prefixes", mode="before")
    @classmethod
    def _list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part for part in value.replace(",", " ").split() if part]
        return value

    @property
    def enabled(self) -> bool:
        """Whether the table, queue and location are all set."""
        return bool(self.table and self.queue_url and self.location)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AsyncSettings:
        """Settings from ``ASYNC_*`` variables (empty values count as unset)."""
        return cls.model_validate(prefixed_values(cls, ENV_PREFIX, environ))
