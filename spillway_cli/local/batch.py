"""Local runs of batch jobs: AWS Batch on moto, and test-only fault injection.

moto accepts AWS Batch calls (with ``{"batch": {"use_docker": false}}`` it marks jobs
succeeded without running anything), so submission and status use the same code as on
AWS. To make a local job really produce its outputs, ``run_local`` reads the submitted
job back from Batch (command, environment, array size) and runs each array child as a
process with the variables AWS Batch would set, retrying failed children like the job's
retry strategy does. ``launcher`` replaces the container's ``spillway jobs`` entry point.

``FaultSettings`` (``SPILLWAY_FAULT_*``) make ``spillway jobs run`` pause mid-shard so a
test can kill it; they live here, outside the deployed ``batch_job`` package.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from batch_job.errors import EXIT_NO_RETRY
from batch_job.settings import JobsSettings
from spillway.aws.clients import aws_client

if TYPE_CHECKING:
    from batch_job.runner import BatchHook, JobRunner

log = logging.getLogger("spillway.jobs.local")

_ROLE = "spillway-batch-service"
_COMPUTE = "spillway-local"


@dataclass(frozen=True)
class ChildRun:
    """One array child's local execution."""

    index: int | None
    attempts: int
    exit_code: int
    log_path: Path


def configure_moto(endpoint: str) -> None:
    """Tell a moto server to accept Batch jobs without Docker."""
    request = urllib.request.Request(  # noqa: S310 - the configured local moto endpoint
        f"{endpoint.rstrip('/')}/moto-api/config",
        data=json.dumps({"batch": {"use_docker": False}}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
        response.read()


def create_resources(settings: JobsSettings) -> None:
    """The Batch queue and job definition and the DynamoDB table, if missing (moto only:
    on AWS they come from ``infra/``)."""
    iam, batch = aws_client("iam", settings.region), aws_client("batch", settings.region)
    try:
        role = iam.get_role(RoleName=_ROLE)["Role"]["Arn"]
    except iam.exceptions.NoSuchEntityException:
        trust = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Principal": {"Service": "batch.amazonaws.com"},
                    "Action": "sts:AssumeRole",
                }
            ],
        }
        role = iam.create_role(RoleName=_ROLE, AssumeRolePolicyDocument=json.dumps(trust))
        role = role["Role"]["Arn"]
    if not batch.describe_compute_environments(computeEnvironments=[_COMPUTE])[
        "computeEnvironments"
    ]:
        batch.create_compute_environment(
            computeEnvironmentName=_COMPUTE, type="UNMANAGED", state="ENABLED", serviceRole=role
        )
    if not batch.describe_job_queues(jobQueues=[settings.job_queue])["jobQueues"]:
        batch.create_job_queue(
            jobQueueName=settings.job_queue,
            state="ENABLED",
            priority=1,
            computeEnvironmentOrder=[{"order": 1, "computeEnvironment": _COMPUTE}],
        )
    active = batch.describe_job_definitions(
        jobDefinitionName=settings.job_definition, status="ACTIVE"
    )["jobDefinitions"]
    if not active:
        batch.register_job_definition(
            jobDefinitionName=settings.job_definition,
            type="container",
            containerProperties={
                "image": "spillway-gpu:local",
                "command": ["spillway", "jobs", "run"],
                "resourceRequirements": [
                    {"type": "VCPU", "value": "2"},
                    {"type": "MEMORY", "value": "4096"},
                ],
            },
        )
    _create_table(settings)


def _create_table(settings: JobsSettings) -> None:
    dynamodb = aws_client("dynamodb", settings.region)
    if settings.table in dynamodb.list_tables()["TableNames"]:
        return
    dynamodb.create_table(
        TableName=settings.table,
        KeySchema=[{"AttributeName": "job_id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "job_id", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )


def run_local(
    settings: JobsSettings,
    batch_job_id: str,
    launcher: Sequence[str],
    log_dir: Path,
    parallel: int = 2,
) -> list[ChildRun]:
    """Run every array child of a submitted Batch job as a local process."""
    job: dict[str, Any] = aws_client("batch", settings.region).describe_jobs(jobs=[batch_job_id])[
        "jobs"
    ][0]
    command = list(job["container"]["command"])
    if command[:2] != ["spillway", "jobs"]:
        raise ValueError(f"job {batch_job_id} does not run `spillway jobs`: {command[:3]}")
    argv = [*launcher, *command[2:]]
    env = {e["name"]: e["value"] for e in job["container"].get("environment", [])}
    env["JOBS_PROGRESS_BAR"] = "false"
    # The children's spans are the batch job's, not those of the process that runs them
    # (the local jobs API is `spillway-jobs`), unless the job definition names a service.
    env.setdefault("OTEL_SERVICE_NAME", "spillway-batch")
    size = job.get("arrayProperties", {}).get("size")
    indices: list[int | None] = list(range(size)) if size else [None]
    log_dir.mkdir(parents=True, exist_ok=True)

    def child(index: int | None) -> ChildRun:
        name = batch_job_id if index is None else f"{batch_job_id}:{index}"
        log_path = log_dir / f"child-{'main' if index is None else index}.log"
        code = -1
        for attempt in range(1, settings.retry_attempts + 1):
            variables = {**env, "AWS_BATCH_JOB_ID": name, "AWS_BATCH_JOB_ATTEMPT": str(attempt)}
            if index is not None:
                variables["AWS_BATCH_JOB_ARRAY_INDEX"] = str(index)
            with log_path.open("ab") as out:
                try:
                    code = subprocess.run(  # noqa: S603 - argv from our own job definition
                        argv,
                        env={**os.environ, **variables},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        timeout=settings.attempt_timeout_s,
                        check=False,
                    ).returncode
                except subprocess.TimeoutExpired:  # killed, as Batch does past the timeout
                    code = -9
            log.info("child %s attempt %d exited with %d", name, attempt, code)
            if code in (0, EXIT_NO_RETRY):
                return ChildRun(index, attempt, code, log_path)
        return ChildRun(index, settings.retry_attempts, code, log_path)

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(child, indices))


# --- fault injection (tests only) -----------------------------------------------------


class FaultSettings(BaseSettings):
    """Test-only fault injection for ``spillway jobs run`` (``SPILLWAY_FAULT_<FIELD>``).
    Never set in production."""

    model_config = SettingsConfigDict(env_prefix="SPILLWAY_FAULT_", extra="ignore")

    pause_after_records: int | None = Field(default=None, ge=1)
    """After this many records the runner logs ``fault injection: pausing`` (once the
    shards before the current one are committed) and sleeps ``pause_s``, so a test can
    kill it mid-shard."""
    pause_s: float = Field(default=600.0, gt=0)
    """How long the pause lasts."""


def fault_hook(settings: FaultSettings) -> BatchHook | None:
    """The runner's batch hook that pauses once, or ``None`` when no fault is set."""
    limit = settings.pause_after_records
    if limit is None:
        return None
    seen = 0

    def pause_once(runner: JobRunner, records: int, errors: int) -> None:
        nonlocal seen
        if seen >= limit:
            return
        seen += records
        if seen >= limit:
            runner.wait_for_commit()  # the shards before this one are committed
            log.warning("fault injection: pausing after %d records", seen)
            for handler in logging.getLogger().handlers:
                handler.flush()
            time.sleep(settings.pause_s)

    return pause_once
