"""Helpers shared by the batch-job integration tests (no tests here).

They live in a ``test_jobs*`` module so the jobs tests stay within their own files; each
test module wraps them in its own fixtures.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from batch_job.settings import JobsSettings
from spillway.aws.clients import aws_client
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.repository import LocalRepository
from spillway_cli.local.batch import configure_moto, create_resources

CPU_ONLY = ("CPUExecutionProvider",)
EXAMPLE_API_KEY_ID = "abcde12345"
"""The API key id of the caller in ``events/jobs/*.json`` (unmapped: its own tenant)."""


def jobs_settings(endpoint: str, models_dir: Path, **overrides: Any) -> JobsSettings:
    """Settings pointing at the moto server's Batch queue and job table (created here)."""
    configure_moto(endpoint)
    settings = JobsSettings(
        repository=str(models_dir),
        providers=CPU_ONLY,
        job_queue="spillway-test-queue",
        job_definition="spillway-test-job",
        table="spillway-test-jobs",
        progress_interval_s=0.5,
        progress_bar=False,
        **overrides,
    )
    create_resources(settings)
    return settings


def new_bucket() -> str:
    """A fresh bucket on the moto server."""
    bucket = f"jobs-{uuid.uuid4().hex[:12]}"
    aws_client("s3").create_bucket(Bucket=bucket)
    return bucket


def load_model(models_dir: Path, name: str) -> OnnxModel:
    """The model as the engine serves it, for reference results."""
    repo = LocalRepository(models_dir)
    version = repo.list_versions(name)[-1]
    path = repo.fetch_version(name, version, cache_dir=models_dir)
    return OnnxModel(name, version, repo.read_config(name), path, EngineOptions())


def digits_images(models_dir: Path) -> np.ndarray:
    """The held-out digits images, float32 ``[N, 8, 8]``."""
    images: np.ndarray = np.load(models_dir / "digits" / "samples" / "images.npy")
    return images.astype(np.float32)


def put_jsonl(bucket: str, key: str, lines: list[str]) -> None:
    """An input file of raw lines."""
    aws_client("s3").put_object(Bucket=bucket, Key=key, Body="\n".join(lines) + "\n")


def record(record_id: str, **data: Any) -> str:
    """One input line."""
    return json.dumps({"id": record_id, "data": data})


def get_lines(bucket: str, key: str) -> list[dict[str, Any]]:
    """A JSON Lines object, parsed."""
    body = aws_client("s3").get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def get_npy(bucket: str, key: str, tmp: Path) -> np.ndarray:
    """An ``.npy`` output, loaded without pickle."""
    path = tmp / key.replace("/", "_")
    aws_client("s3").download_file(bucket, key, str(path))
    array: np.ndarray = np.load(path, allow_pickle=False)
    return array


def committed(bucket: str, prefix: str) -> list[str]:
    """Names of the committed shards under an output prefix."""
    listed = aws_client("s3").list_objects_v2(Bucket=bucket, Prefix=f"{prefix}_committed/")
    return sorted(o["Key"].rsplit("/", 1)[-1] for o in listed.get("Contents", []))


def snapshot(bucket: str, keys: list[str]) -> dict[str, tuple[str, Any, bytes]]:
    """ETag, LastModified and content of objects, to prove they were not rewritten."""
    s3 = aws_client("s3")
    found = {}
    for key in keys:
        obj = s3.get_object(Bucket=bucket, Key=key)
        found[key] = (obj["ETag"], obj["LastModified"], obj["Body"].read())
    return found


def ids_seen(bucket: str, prefix: str, shards: int) -> Counter[str]:
    """How often each id appears across every shard's outputs and errors."""
    seen: Counter[str] = Counter()
    for index in range(shards):
        for suffix in ("jsonl", "errors.jsonl"):
            for line in get_lines(bucket, f"{prefix}part-{index:05d}.{suffix}"):
                seen[str(line["id"])] += 1
    return seen
