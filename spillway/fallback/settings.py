"""CPU-fallback settings: every field from a ``CPU_`` environment variable or a flag."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from spillway.models.engine import CPU, EngineOptions
from spillway.protocol.wire import SYNC_BODY_BYTES


class CpuSettings(BaseSettings):
    """Settings of the CPU-fallback function (``CPU_<FIELD>`` in the environment)."""

    model_config = SettingsConfigDict(env_prefix="CPU_", extra="ignore", frozen=True)

    repository: str = "models"
    """Model repository: a folder (e.g. packaged with the function) or ``s3://bucket/prefix``."""
    models: list[str] | None = None
    """Models to serve (JSON list); unset: every model in the repository."""
    preload: bool | None = None
    """Load every served version at init (true), or each when a request first needs it
    (false). Unset: at init, except in a Lambda environment started on demand
    (``AWS_LAMBDA_INITIALIZATION_TYPE=on-demand``), where a cold start's first request
    would otherwise wait for every model's load; provisioned concurrency and SnapStart
    initialise before any request, so they load at init."""
    cache_dir: Path = Path("/tmp/spillway-models")  # noqa: S108 - Lambda's writable cache
    """Where versions fetched from S3 are kept (Lambda: under /tmp)."""
    max_payload_bytes: int = Field(default=SYNC_BODY_BYTES, ge=1024)
    """Largest request and response body: the invoke event carries it base64 within
    Lambda's 6 MB synchronous payload, so about 4.4 MiB (docs/deploy.md)."""
    index_refresh_s: float = Field(default=60.0, gt=0)
    """How often each model's configuration and published versions are read from the
    repository again: a version published (and served by the model's ``version_policy``)
    after start-up is loaded when a request first asks for it."""
    index_miss_refresh_s: float = Field(default=1.0, ge=0)
    """A request for a model or a version the last read did not list reads the repository
    again: its model list at most this often in all, a model's versions at most this often
    per model, concurrent requests sharing one read (a model or version published a moment
    ago is found at once; a client inventing names costs one listing per this time)."""
    memory_budget_mb: float | None = Field(default=None, gt=0)
    """Memory for loaded versions (their files' size x 1.5 each); a load that does not fit
    evicts the least recently used versions first, and one larger than the budget fails
    with 503 ``insufficient_memory``. Unset: no limit (the function's memory size is)."""
    intra_op_threads: int = Field(default=0, ge=0)
    """Threads inside one ONNX Runtime operator (0: ONNX Runtime decides)."""
    max_elements_per_input: int = Field(default=16 * 1024 * 1024, ge=1)
    """Largest element count of one input tensor."""
    function_name: str = "spillway-cpu-infer"
    """The name the local Lambda-invoke endpoint of ``spillway serve cpu`` answers to."""
    host: str = "127.0.0.1"
    """Address ``spillway serve cpu`` listens on."""
    port: int = Field(default=8081, ge=0, le=65535)
    """Port ``spillway serve cpu`` listens on."""
    log_level: str = "INFO"
    """Log level of the function (until the live configuration names one)."""
    config_table: str | None = None
    """The router's state table, whose ``config#live`` item holds the live configuration
    (``spillway config log-level``): read at init and every ``config_ttl_s``."""
    config_ttl_s: float = Field(default=30.0, ge=0, le=3600)
    """How long the live configuration is used before it is read again."""
    tracing: bool = False
    """Create the function's X-Ray tracer (imported only when true, so cold starts do not
    pay for it)."""

    def preloads(self, environ: Mapping[str, str] = os.environ) -> bool:
        """Whether init loads every served version (``preload``; unset: all but an
        on-demand Lambda initialisation). The variable is Lambda's own:
        https://docs.aws.amazon.com/lambda/latest/dg/configuration-envvars.html#configuration-envvars-runtime
        """
        if self.preload is not None:
            return self.preload
        return environ.get("AWS_LAMBDA_INITIALIZATION_TYPE") != "on-demand"

    def engine_options(self) -> EngineOptions:
        """Engine options: the CPU provider only."""
        return EngineOptions(
            providers=(CPU,),
            intra_op_threads=self.intra_op_threads,
            max_elements_per_input=self.max_elements_per_input,
        )
