"""``spillway jobs``: run a job's shards (the container's command), submit, track.

``run`` is what the AWS Batch job definition executes; as an array child it reads
``AWS_BATCH_JOB_ARRAY_INDEX`` and runs only its shards. ``submit`` and ``status`` use the
same service as the jobs Lambda. ``submit --local`` also executes the array children as
local processes (moto does not run containers). ``JOBS_*`` variables configure all three.

Exit codes of ``run``: 0 every shard committed, 1 a shard failed (Batch retries; committed
shards are skipped), 3 a configuration error that a retry cannot fix. ``run`` also reads
the test-only ``SPILLWAY_FAULT_*`` variables (``spillway_cli.local.batch.FaultSettings``).

``submit`` and ``status`` reach a stack started by ``spillway up`` through its stack env
file (``spillway_cli.local.stackenv``: its endpoint, tables, queue and model repository) when
the environment does not name them; ``status`` takes the short id the progress bar shows.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from batch_job.errors import EXIT_NO_RETRY
from batch_job.jobstore import JobStore
from batch_job.plan import RunSpec
from batch_job.service import JobService
from batch_job.settings import JobsSettings
from spillway.protocol.errors import InvalidInputError, JobNotFoundError, SpillwayError
from spillway.protocol.messages import JobRequest, JobStatus
from spillway.state.table import scope
from spillway.tenancy.identity import tenant_hint
from spillway_cli.local.batch import (
    FaultSettings,
    configure_moto,
    create_resources,
    fault_hook,
    run_local,
)
from spillway_cli.local.stackenv import aws_errors, require_aws, use_stack_env

jobs_app = typer.Typer(help="Offline batch inference on AWS Batch.", no_args_is_help=True)
log = logging.getLogger("spillway.jobs.cli")

LAUNCHER = (sys.executable, "-m", "spillway_cli.jobs_cli")
"""How a local child runs ``spillway jobs`` (the container's entry point)."""
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "INCOMPLETE"})
SHORT_ID = re.compile(r"^[0-9a-f-]{4,36}$")
SHORT_ID_SHOWN = 8
"""The characters of a job id the progress bar shows."""


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _fail(exc: SpillwayError, code: int = EXIT_NO_RETRY) -> typer.Exit:
    typer.echo(f"error ({exc.code}): {exc.message}", err=True)
    return typer.Exit(code)


@jobs_app.command("run")
def run(
    model: Annotated[str, typer.Option(help="Model name.")],
    input: Annotated[str, typer.Option("--input", help="s3://bucket/prefix/ of the inputs.")],
    output: Annotated[str, typer.Option(help="s3://bucket/prefix/ for outputs.")],
    repository: Annotated[str | None, typer.Option(help="Folder or s3://… repository.")] = None,
    version: Annotated[int | None, typer.Option(min=1, help="Default: latest.")] = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Rows per run.")] = None,
    verbose: bool = False,
) -> None:
    """Run this child's shards (all shards outside an array job); skip committed ones."""
    from batch_job.runner import run_job  # onnxruntime and numpy only for this command

    _logging(verbose)
    settings = JobsSettings()
    spec = RunSpec(model, input, output, version, batch_size)
    try:
        result = run_job(spec, settings, repository, fault_hook(FaultSettings()))
    except SpillwayError as exc:
        raise _fail(exc) from None
    typer.echo(
        f"committed {len(result.committed)}, already committed {len(result.skipped)}, "
        f"failed {len(result.failed)} shards; {result.records} records in {result.seconds:.1f} s"
    )
    if result.failed:
        raise typer.Exit(1)


@jobs_app.command("submit")
def submit(
    model: Annotated[str, typer.Option(help="Model name.")],
    input: Annotated[str, typer.Option("--input", help="s3://bucket/prefix/ of the inputs.")],
    output: Annotated[str, typer.Option(help="s3://bucket/prefix/ for outputs.")],
    version: Annotated[int | None, typer.Option(min=1, help="Default: latest.")] = None,
    shards: Annotated[int | None, typer.Option(min=1, help="Array children.")] = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Rows per run.")] = None,
    idempotency_key: Annotated[str | None, typer.Option(help="Same key, same job.")] = None,
    wait: Annotated[bool, typer.Option(help="Show progress until the job ends.")] = False,
    local: Annotated[bool, typer.Option(help="Run the children here (moto).")] = False,
    tenant: Annotated[
        str | None,
        typer.Option(help="Submit as this tenant: locations in its areas, output per job."),
    ] = None,
) -> None:
    """Plan shards, submit the AWS Batch array job and record it (idempotent per key).

    With the operator's credentials: without ``--tenant`` the job is the operator's
    (``JOBS_OPERATOR_TENANT``) and writes where ``--output`` says; with it, the job is
    that tenant's and follows the jobs API's rules (its areas, ``<output>/<job id>/``)."""
    _logging(False)
    use_stack_env()
    require_aws()
    settings = JobsSettings()
    service = JobService(settings)
    fields: dict[str, Any] = {"model": model, "input": input, "output": output}
    fields |= {"version": version, "shards": shards, "batch_size": batch_size}
    try:
        request = JobRequest.parse(json.dumps(fields))
        with aws_errors():
            if tenant is None:
                result = service.submit_as_operator(request, idempotency_key)
            else:
                result = service.submit(request, idempotency_key, tenant=tenant_hint(tenant))
    except SpillwayError as exc:
        raise _fail(exc) from None
    typer.echo(result.model_dump_json(indent=2))
    if local and result.job.batch_job_id:
        log_dir = Path(tempfile.mkdtemp(prefix=f"spillway-job-{result.job.job_id[:8]}-"))
        runs = run_local(settings, result.job.batch_job_id, LAUNCHER, log_dir)
        for child in runs:
            which = "the job" if child.index is None else f"array child {child.index}"
            typer.echo(f"{which}: exit {child.exit_code} ({child.log_path})")
    if wait:
        final = _wait(service, result.job.job_id, tenant)
        typer.echo(final.model_dump_json(indent=2))
        if final.state != "SUCCEEDED":
            raise typer.Exit(1)


def _status(service: JobService, job_id: str, tenant: str | None) -> JobStatus:
    if tenant is None:
        return service.status_as_operator(job_id)
    return service.status(job_id, tenant=tenant_hint(tenant))


def _wait(service: JobService, job_id: str, tenant: str | None, poll_s: float = 5.0) -> JobStatus:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()) as bar:
        short = job_id[:SHORT_ID_SHOWN]
        task = bar.add_task(f"job {short}", total=None)
        while True:
            current = _status(service, job_id, tenant)
            bar.update(
                task,
                total=current.shards_total,
                completed=current.shards_done,
                description=f"job {short} {current.state} ({current.records} records)",
            )
            if current.state in TERMINAL:
                return current
            time.sleep(poll_s)


@jobs_app.command("status")
def status(
    job_id: Annotated[
        str, typer.Argument(help="The job id submit printed, or its first characters.")
    ],
    tenant: Annotated[
        str | None, typer.Option(help="Only this tenant's job (default: any, as operator).")
    ] = None,
) -> None:
    """The job's state: Batch's view and its committed shards, records and errors."""
    use_stack_env()
    require_aws()
    try:
        with aws_errors():
            service = JobService(JobsSettings())
            owner = None if tenant is None else scope(tenant_hint(tenant))
            full = resolve_job_id(service.store, job_id, owner)
            typer.echo(_status(service, full, tenant).model_dump_json(indent=2))
    except SpillwayError as exc:
        raise _fail(exc, 1) from None


def resolve_job_id(store: JobStore, given: str, owner: str | None) -> str:
    """The job id that ``given`` is, or begins (the short id the progress bar shows),
    among ``owner``'s jobs (every job for ``None``, the operator); one match or an error."""
    try:
        uuid.UUID(given)
    except ValueError:
        pass
    else:
        return given
    prefix = given.lower()
    if not SHORT_ID.match(prefix):
        raise InvalidInputError("a job id is a UUID, or its first characters (at least 4)")
    pages = store.client.get_paginator("scan").paginate(
        TableName=store.table,
        FilterExpression="begins_with(#id, :prefix)",
        ProjectionExpression="#id, #owner",
        ExpressionAttributeNames={"#id": "job_id", "#owner": "owner"},
        ExpressionAttributeValues={":prefix": {"S": prefix}},
    )
    found: list[str] = sorted(
        str(item["job_id"]["S"])
        for page in pages
        for item in page.get("Items", [])
        if owner is None or item.get("owner", {}).get("S") == owner
    )
    if not found:
        raise JobNotFoundError(f"no job {given}")
    if len(found) > 1:
        raise InvalidInputError(
            f"{given} begins {len(found)} job ids ({', '.join(found[:3])}…): give more of it"
        )
    return found[0]


@jobs_app.command("init-local")
def init_local() -> None:
    """Point at moto (AWS_ENDPOINT_URL): allow Batch without Docker, create the queue,
    job definition and job table."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        typer.echo("AWS_ENDPOINT_URL must point at a moto server", err=True)
        raise typer.Exit(2)
    configure_moto(endpoint)
    create_resources(JobsSettings())
    typer.echo(f"Batch queue, job definition and table ready on {endpoint}")


def run_submitted_locally(
    handler: Callable[[dict[str, Any], Any], dict[str, Any]],
) -> Callable[[dict[str, Any], Any], dict[str, Any]]:
    """The jobs handler, plus: each newly submitted job's children run here in the
    background (moto records Batch jobs but never runs them)."""

    def wrapped(event: dict[str, Any], context: Any) -> dict[str, Any]:
        result = handler(event, context)
        if event.get("httpMethod") == "POST" and result.get("statusCode") in (200, 201, 202):
            try:
                document = json.loads(result.get("body") or "{}")
                batch_job_id = document["job"]["batch_job_id"]
            except (ValueError, KeyError, TypeError):
                return result
            if not document.get("replayed"):
                log_dir = Path(tempfile.mkdtemp(prefix="spillway-job-"))
                args = (JobsSettings(), batch_job_id, LAUNCHER, log_dir)
                threading.Thread(target=run_local, args=args, daemon=True).start()
        return result

    return wrapped


if __name__ == "__main__":
    jobs_app()
