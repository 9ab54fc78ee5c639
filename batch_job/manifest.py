"""Shard manifests and completion markers, and the progress they add up to.

A committed shard has a marker at ``<output>/_committed/part-NNNNN.json`` holding the
same manifest as ``part-NNNNN.manifest.json``; a shard without a marker did not happen,
whatever other objects it left. Status reads only the markers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel, ConfigDict, Field

from batch_job.plan import OutputLayout
from batch_job.storage import ObjectStore


class ShardManifest(BaseModel):
    """What one committed shard holds and how it was made."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shard: str
    input: str
    input_etag: str = ""
    format: str
    model: str
    model_version: int
    records: int = Field(ge=0)
    outputs: int = Field(ge=0)
    errors: int = Field(ge=0)
    batch_size: int = Field(ge=1)
    batches: int = Field(ge=0)
    batch_failures: int = Field(ge=0)
    files: list[str]
    """Final keys of the shard's outputs and errors (the manifest and marker aside)."""
    started_at: str
    finished_at: str
    seconds: float = Field(ge=0)
    records_per_s: float = Field(ge=0)
    run_id: str
    """Unique per runner process: a re-run that rewrote this shard would change it."""
    batch_job_id: str | None = None
    attempt: int | None = None


class Totals(BaseModel):
    """Committed shards and the records they hold."""

    shards_done: int = 0
    records: int = 0
    outputs: int = 0
    errors: int = 0


def read_markers(
    store: ObjectStore, layout: OutputLayout, concurrency: int = 16
) -> list[ShardManifest]:
    """The manifests of every committed shard, in shard order."""
    keys = [o.key for o in store.list_objects(layout.committed_prefix) if o.key.endswith(".json")]
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(keys)))) as pool:
        bodies = list(pool.map(store.get_bytes, keys))
    return [ShardManifest.model_validate_json(b) for b in bodies if b is not None]


def totals(manifests: list[ShardManifest]) -> Totals:
    """Sums over committed shards."""
    return Totals(
        shards_done=len(manifests),
        records=sum(m.records for m in manifests),
        outputs=sum(m.outputs for m in manifests),
        errors=sum(m.errors for m in manifests),
    )
