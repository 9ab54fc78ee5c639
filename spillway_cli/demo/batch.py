"""The demo's batch section: an offline job over an S3 prefix, submitted as the
operator submits it, its array children run here (moto records Batch jobs but runs
none), its shards shown as a progress bar, and its output records checked."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from spillway.protocol.messages import JobStatus
from spillway_cli.console import Check, Checks, at_least, equal
from spillway_cli.demo.report import say
from spillway_cli.demo.serving import ACCURACY_BOUND
from spillway_cli.local.names import DATA_BUCKET, REGION
from spillway_cli.local.stack import LocalStack


def scenario_batch(
    stack: LocalStack, models: Path, out: Path, checks: Checks, section: str
) -> list[Check]:
    """Write 300 digits records to S3, run a job over them; the job must succeed for the
    rest to be checked (``section``: the name its checks are recorded under)."""
    from spillway.aws.clients import aws_client

    images = np.load(models / "digits/samples/images.npy", allow_pickle=False)[:300]
    s3 = aws_client("s3", REGION)
    for shard in range(3):
        lines = [
            json.dumps({"id": f"img-{shard}-{i}", "data": {"image": img.tolist()}})
            for i, img in enumerate(images[shard * 100 : (shard + 1) * 100])
        ]
        s3.put_object(
            Bucket=DATA_BUCKET,
            Key=f"inputs/digits/part-{shard}.jsonl",
            Body="\n".join(lines).encode(),
        )
    status = run_batch_job(stack, "digits", "inputs/digits/", "outputs/digits/", out / "jobs")
    say(
        f"   job {status.job_id[:8]} {status.state}: {status.shards_done}/{status.shards_total} "
        f"shards, {status.records} records, {status.errors} errors (logs: {out / 'jobs'})"
    )
    checks.require(section, equal("the job's state", status.state, "SUCCEEDED"))
    listing = s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix="outputs/digits/")
    keys = [o["Key"] for o in listing.get("Contents", [])]
    outputs = [k for k in keys if k.endswith(".jsonl") and not k.endswith(".errors.jsonl")]
    truth = np.load(models / "digits/samples/labels.npy", allow_pickle=False)[:300]
    correct = total = 0
    for key in outputs:
        for line in s3.get_object(Bucket=DATA_BUCKET, Key=key)["Body"].read().splitlines():
            record = json.loads(line)
            shard, index = (int(x) for x in record["id"].split("-")[1:])
            correct += int(np.ravel(record["outputs"]["label"])[0] == truth[shard * 100 + index])
            total += 1
    accuracy = correct / total if total else 0.0
    say(f"   {total} output records in {len(outputs)} files; accuracy {accuracy:.4f}")
    return [
        equal("records the job counted", status.records, 300),
        equal("records the job failed", status.errors, 0),
        equal("output records", total, 300),
        at_least("accuracy of the output records", round(accuracy, 4), ACCURACY_BOUND),
    ]


def run_batch_job(
    stack: LocalStack, model: str, inputs: str, outputs: str, log_dir: Path
) -> JobStatus:
    """Submit a job as the operator does (``spillway jobs submit``: the operator tenant's,
    writing where it says), run its array children here (moto records Batch jobs but runs
    none) and show its shards as a progress bar until it ends."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from batch_job.service import JobService
    from batch_job.settings import JobsSettings
    from spillway.protocol.messages import JobRequest
    from spillway_cli.jobs_cli import LAUNCHER
    from spillway_cli.local.batch import run_local

    os.environ.update(stack.jobs_env())  # the children inherit it, as the jobs API's do
    settings = JobsSettings()
    service = JobService(settings)
    fields = {"model": model, "input": f"s3://{DATA_BUCKET}/{inputs}"}
    request = JobRequest.parse(json.dumps({**fields, "output": f"s3://{DATA_BUCKET}/{outputs}"}))
    job = service.submit_as_operator(request).job
    if job.batch_job_id is None:
        raise RuntimeError(f"job {job.job_id} reached no Batch queue")
    children = threading.Thread(
        target=run_local, args=(settings, job.batch_job_id, LAUNCHER, log_dir), daemon=True
    )
    children.start()
    columns = (TextColumn("   {task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns) as bar:
        task = bar.add_task(f"job {job.job_id[:8]}", total=job.shards_total)
        # Batch's own state is no guide here (moto settles a job it never ran): the job
        # is over when its children are, and its status then reads the shard markers.
        while True:
            ended = not children.is_alive()
            status = service.status_as_operator(job.job_id)
            bar.update(task, completed=status.shards_done)
            if ended:
                return status
            time.sleep(0.5)
