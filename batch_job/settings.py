"""Settings of the batch job and the jobs function: ``JOBS_<FIELD>`` in the environment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from spillway import tracing
from spillway.envsettings import json_mapping


class JobsSettings(BaseSettings):
    """Settings of the job container, the jobs Lambda and the CLI (``JOBS_<FIELD>``)."""

    model_config = SettingsConfigDict(env_prefix="JOBS_", extra="ignore", populate_by_name=True)

    # --- the job container -------------------------------------------------------------
    repository: str = "models"
    """Model repository the job container loads from: a folder or ``s3://bucket/prefix``."""
    cache_dir: Path = Path("/tmp/spillway-models")  # noqa: S108 - a cache, not a secret
    """Where versions downloaded from S3 are kept."""
    work_dir: Path | None = None
    """Scratch space for shard inputs and outputs (default: the system temp folder); work
    folders a killed run left there are removed when the next run starts."""
    providers: tuple[str, ...] = ("CUDAExecutionProvider", "CPUExecutionProvider")
    """ONNX Runtime execution providers in order of preference; a CPU fallback is logged."""
    intra_op_threads: int = Field(default=0, ge=0)
    """Threads inside one ONNX Runtime operator (0: ONNX Runtime decides)."""
    batch_size: int | None = Field(default=None, ge=1)
    """Rows per ONNX Runtime run (default: the model's ``max_batch_size``)."""
    array_index: int | None = Field(
        default=None,
        ge=0,
        validation_alias=AliasChoices("AWS_BATCH_JOB_ARRAY_INDEX", "JOBS_ARRAY_INDEX"),
    )
    """This array child's index, set by AWS Batch; unset: run every shard."""
    array_size: int | None = Field(default=None, ge=1)
    """Children of the array job (set by the submitter); child ``i`` runs shards ``i, i+n…``."""
    max_record_bytes: int = Field(default=1 << 20, ge=1)
    """Longest JSON Lines record in bytes; a longer line is an error record
    (``payload_too_large``) and is skipped without being held in memory."""
    progress_interval_s: float = Field(default=10.0, gt=0)
    """Seconds between progress lines in the log."""
    progress_bar: bool = True
    """Show a progress bar when stdout is a terminal."""

    # --- submission (the jobs Lambda and ``spillway jobs submit``) ---------------------
    region: str | None = None
    """AWS region of Batch and DynamoDB (default: boto3's own resolution)."""
    job_queue: str = "spillway-jobs"
    """AWS Batch job queue the array jobs are submitted to."""
    job_definition: str = "spillway-batch-job"
    """AWS Batch job definition (the GPU image running ``spillway jobs run``)."""
    retry_attempts: int = Field(default=3, ge=1, le=10)
    """Attempts per array child; a retried child skips the shards it already committed."""
    attempt_timeout_s: int = Field(default=4 * 3600, ge=60)
    """AWS Batch ``attemptDurationSeconds`` of one child attempt."""
    max_array_size: int = Field(default=100, ge=1, le=10_000)
    """Most array children one job may use (shards beyond it are shared round-robin)."""
    table: str = "spillway-jobs"
    """DynamoDB table of job records (partition key ``job_id``, TTL on ``expires_at``)."""
    record_ttl_days: int = Field(default=30, ge=1)
    """Days a job record (and so its idempotency key) is kept."""
    submit_lease_s: float = Field(default=60.0, gt=0)
    """A submission that crashed before reaching Batch may be taken over after this long."""
    status_read_concurrency: int = Field(default=16, ge=1, le=64)
    """Parallel reads of shard markers when computing a job's status."""

    tenant_scope: str | None = None
    """The scope (``spillway.state.table.scope``) of the tenant whose job this container
    runs, set by the submitter in the Batch job's environment."""
    traceparent: str | None = Field(
        default=None, validation_alias=AliasChoices("TRACEPARENT", "JOBS_TRACEPARENT")
    )
    """The W3C ``traceparent`` of the request that submitted the job, set by the submitter
    in the Batch job's environment: the job's spans join its trace (a malformed one is
    ignored)."""
    tracestate: str | None = Field(
        default=None, validation_alias=AliasChoices("TRACESTATE", "JOBS_TRACESTATE")
    )
    """The ``tracestate`` beside ``traceparent``."""

    def trace(self) -> dict[str, str]:
        """The job's trace carrier (``spillway.tracing.carrier_of``; ``{}``: none)."""
        return tracing.carrier_of({"traceparent": self.traceparent, "tracestate": self.tracestate})

    # --- callers and their areas (the jobs Lambda) --------------------------------------
    tenants_root: str | None = None
    """``s3://bucket/prefix`` of the tenants' job data: a tenant's jobs read and write only
    under ``<root>/<scope>/`` (``scope``: a digest of the tenant). Unset: no API job may
    name a location outside the router's staging."""
    staging: str | None = None
    """The router's batch-mode staging (``ROUTER_JOBS_STAGING``): a tenant's jobs may also
    read and write under ``<staging>/<scope>/``, where the router staged its requests."""
    identity_tenants: dict[str, str] = Field(default_factory=dict)
    """Tenants of authenticated identities, as JSON: ``{"<API key id or IAM principal
    ARN>": "<tenant>"}``; an unmapped identity is its own tenant (as the router's). A base
    under the live configuration's map (``config_table``), which deployments use instead."""
    config_table: str | None = None
    """The router's state table, whose ``config#live`` item holds the live configuration
    (``spillway tenants``, ``spillway config``): the identity map and the log level."""
    config_ttl_s: float = Field(default=30.0, ge=0, le=3600)
    """How long the live configuration is used before it is read again."""
    trust_tenant_hints: bool = False
    """Let a caller nothing authenticated name its tenant (``x-spillway-tenant``), or be
    the anonymous tenant without one. Off by default: unauthenticated calls get 401
    ``unauthenticated``. For local runs only."""
    operator_tenant: str = Field(default="operator", pattern=r"^[A-Za-z0-9._:@-]{1,128}$")
    """Tenant of the nightly scheduled job and of ``spillway jobs submit`` without
    ``--tenant``: their locations are the operator's configuration, not a request's."""

    @field_validator("identity_tenants", mode="before")
    @classmethod
    def _json_map(cls, value: Any) -> Any:
        return json_mapping(value)

    # --- the nightly schedule (EventBridge) ---------------------------------------------
    schedule_model: str | None = None
    """Model the scheduled re-scoring runs; unset: scheduled events are refused."""
    schedule_version: int | None = Field(default=None, ge=1)
    """Version for scheduled runs (default: the latest at submission)."""
    schedule_input: str | None = None
    """Input prefix the scheduled run re-scores (``s3://bucket/prefix/``)."""
    schedule_output: str | None = None
    """Output root; each run writes under ``<root>/<YYYY-MM-DD>/``."""
    schedule_shards: int | None = Field(default=None, ge=1)
    """Array children of a scheduled run (default: one per shard, up to the cap)."""

    # --- the jobs Lambda -----------------------------------------------------------------
    tracing: bool = False
    """Create the jobs function's X-Ray tracer (imported only when true, so cold starts
    do not pay for it)."""
